"""`dflash-trt build` with `backend: trtllm-pytorch` on tiny random pairs: the LLM() arguments Triton's
llmapi model hands to TensorRT-LLM (>= 1.3, PyTorch backend), per drafter family, and the refusals.

TensorRT-LLM cannot be installed here, so every key asserted below is the one its source reads, cited as
NVIDIA/TensorRT-LLM <file> @ <commit> (the stored snapshots; the 2.5 GB repository is too large to check
out, so classes and fields are cited by name rather than line):
  tensorrt_llm/llmapi/llm_args.py @ 0004396720054fd8e205cbf616f21f0b57c6b412
    DecodingBaseConfig: max_draft_len, speculative_model (alias speculative_model_dir)
    DFlashDecodingConfig: decoding_type Literal["DFlash"], mask_token_id, target_layer_ids,
        attention_backend Literal["VANILLA", "TRTLLM"] (TRTLLM: "Blackwell GPU with SM100 or SM103")
    DSparkDecodingConfig: decoding_type Literal["DSpark"], mask_token_id, target_layer_ids, block_size
        ("Should equal max_draft_len"), markov_rank, markov_head_type, attention_backend
    BaseLlmArgs: model, tokenizer, tensor_parallel_size, pipeline_parallel_size, moe_expert_parallel_size,
        dtype, kv_cache_config, max_batch_size, max_seq_len, max_num_tokens (default 8192)
    KvCacheConfig.dtype ('auto' keeps the checkpoint's kv_cache_quant_algo; 'fp8' overrides)
    TorchLlmArgs: cuda_graph_config (BaseCudaGraphConfig.batch_sizes), attn_backend (default 'TRTLLM';
        VANILLA / TRTLLM / FLASHINFER), backend Literal["pytorch"] (deprecated, still accepted)
  tensorrt_llm/_torch/models/modeling_dflash.py @ 7c7504c08f1f4e389e0e4312ef947f72a87cbcfb
    _build_dflash_draft: a drafter declaring the DSpark heads is refused under decoding_type DFlash
  tensorrt_llm/_torch/models/modeling_dspark.py (GQADSparkForCausalLM): shift_label defaults on (slot 0 =
    anchor, block_size == max_draft_len); markov_head_type other than 'vanilla' raises
  triton_backend/all_models/llmapi/tensorrt_llm/1/model.py: model.yaml minus triton_config -> LLM(**args);
    it imports helpers.py from its own folder
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from click.testing import CliRunner
from conftest import tiny_model_dir

from dflash_trt.cli import main
from dflash_trt.config import DrafterConfig
from dflash_trt.deploy import trtllm
from dflash_trt.deploy.build_config import BuildConfig
from dflash_trt.deploy.stages import Context
from dflash_trt.errors import ConfigError
from dflash_trt.families import domino, dspark
from dflash_trt.modeling.drafter import DFlashDrafter
from dflash_trt.modeling.target import TargetModel

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py

B = 4  # drafter block size
SPARK = {**dspark.DEFAULTS, "markov_rank": 8}
DRAFTERS = {  # folder name -> (architecture, dflash_config family fields)
    "dflash": ("DFlashDraftModel", {}),
    "dspark": ("DSparkDraftModel", SPARK),
    "dspark-gated": ("DSparkDraftModel", {**SPARK, "markov_head_type": "gated"}),
    "dspark-fill-in": ("DSparkDraftModel", {**SPARK, "sample_from_anchor": False}),
    "dflash2": (
        "DFlash2DraftModel",
        {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 16, "selector_top_k": 8},
    ),
    "domino": ("DominoDraftModel", {**domino.DEFAULTS, "emb_dim": 64, "gru_hidden_dim": 32}),
}
# every key the llmapi model.yaml carries for a plain build (BaseLlmArgs / TorchLlmArgs fields)
LLM_KEYS = {
    "model",
    "tokenizer",
    "backend",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "max_batch_size",
    "max_seq_len",
    "max_num_tokens",
    "kv_cache_config",
    "attn_backend",
    "speculative_config",
}
SPEC_KEYS = {"decoding_type", "max_draft_len", "speculative_model", "mask_token_id", "target_layer_ids"}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """root/target (tiny Qwen3 + tokenizer) and root/<family> drafter folders for it."""
    root = tmp_path_factory.mktemp("trtllm")
    tiny_model_dir(root / "target")
    target = TargetModel.from_pretrained(root / "target", dtype=torch.float32)
    for i, (name, (arch, fields)) in enumerate(DRAFTERS.items()):
        cfg = DrafterConfig.for_target(target.config, num_layers=1, block_size=B)
        cfg = dataclasses.replace(cfg, architectures=[arch], family_fields=dict(fields))
        torch.manual_seed(i)
        DFlashDrafter(cfg).save_pretrained(root / name)
    return root


def fields(root: Path, drafter: str = "dflash", **over) -> dict:
    return {
        "target": str(root / "target"),
        "drafter": str(root / drafter),
        "backend": "trtllm-pytorch",
        "max_batch": 4,
        "max_seq_len": 256,
        **over,
    }


def cli(tmp_path: Path, *stage: str, **cfg):
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(cfg))
    return CliRunner().invoke(
        main, ["build", *stage, "--config", str(tmp_path / "b.yaml"), "--out", str(tmp_path / "out")]
    )


def build(tmp_path: Path, **cfg) -> tuple[Path, dict, str]:
    r = cli(tmp_path, **cfg)
    assert r.exit_code == 0, r.output
    out = tmp_path / "out"
    return out, yaml.safe_load((out / "engine" / "model.yaml").read_text()), r.output


def llm_args(root: Path, final: Path, drafter: str = "dflash", **over) -> dict:
    """llmapi_config for a BuildConfig without running a build (the engine stage calls the same function)."""
    cfg = BuildConfig(**fields(root, drafter, **over))
    dirs = {"target": root / "target", "drafter": root / drafter, "tokenizer": root / "target"}
    return trtllm.llmapi_config(Context(cfg, work=final, final=final, dirs=dirs))


# ---- one build per family TensorRT-LLM runs ----------------------------------------------------------------
def test_dflash_build_writes_dflash_decoding_config_and_the_llmapi_repo(pair, tmp_path):
    out, conf, log = build(tmp_path, **fields(pair))
    dc = DrafterConfig.load(pair / "dflash")
    assert set(conf) == LLM_KEYS
    assert conf["speculative_config"] == {
        "decoding_type": "DFlash",
        "max_draft_len": B - 1,  # slots 1..B-1 after the anchor; tokens_per_gen_step = max_draft_len + 1
        "speculative_model": str(out / "engine" / "drafter"),
        "mask_token_id": dc.mask_token_id,
        "target_layer_ids": list(dc.target_layer_ids),
        "attention_backend": "VANILLA",  # sm_90: TensorRT-LLM's TRTLLM drafter attention is SM100/SM103 only
    }
    assert conf["model"] == conf["tokenizer"] == str(pair / "target")
    assert (conf["backend"], conf["attn_backend"], conf["kv_cache_config"]) == ("pytorch", "TRTLLM", {"dtype": "auto"})
    assert (conf["tensor_parallel_size"], conf["pipeline_parallel_size"]) == (1, 1)
    assert (conf["max_batch_size"], conf["max_seq_len"], conf["max_num_tokens"]) == (4, 256, 8192)
    # the drafter TensorRT-LLM loads is the input drafter, byte for byte
    for f in ("config.json", "model.safetensors"):
        assert (out / "engine" / "drafter" / f).read_bytes() == (pair / "dflash" / f).read_bytes()
    # Triton's llmapi model: model.yaml = the LLM() arguments + triton_config (model.py drops that key)
    repo_yaml = yaml.safe_load((out / "model_repo" / "tensorrt_llm" / "1" / "model.yaml").read_text())
    assert repo_yaml.pop("triton_config") == {"max_batch_size": 0, "decoupled": True}
    assert repo_yaml == conf
    readme = (out / "model_repo" / "README.md").read_text()
    for f in ("tensorrt_llm/config.pbtxt", "tensorrt_llm/1/model.py", "tensorrt_llm/1/helpers.py"):
        assert f in readme
    assert "IMAGE=nvcr.io/nvidia/tritonserver:${TRITON_TAG}-trtllm-python-py3\n" in readme
    for f in ("config.pbtxt", "1/model.py", "1/helpers.py"):  # fetched at the container's TensorRT-LLM version
        src = f"/NVIDIA/TensorRT-LLM/v$V/triton_backend/all_models/llmapi/tensorrt_llm/{f}"
        assert f"curl -fsSL -o {out}/model_repo/tensorrt_llm/{f} https://raw.githubusercontent.com{src}" in readme
    run = re.search(
        r"docker run --rm --gpus all (.*?) \$IMAGE \\\n\s+tritonserver --model-repository (\S+)", readme, re.S
    )
    assert run and run.group(2) == str(out / "model_repo")
    mounts = re.findall(r"-v (\S+):(\S+)", run.group(1))
    assert all(a == b for a, b in mounts)  # same path inside: model.yaml's paths are absolute
    assert {a for a, _ in mounts} == {str(out), str(pair / "target")}
    assert "model.yaml (DFlash)" in log


def test_dspark_build_writes_dspark_decoding_config(pair, tmp_path):
    out, conf, _ = build(tmp_path, **fields(pair, "dspark"))
    dc = DrafterConfig.load(pair / "dspark")
    assert conf["speculative_config"] == {
        "decoding_type": "DSpark",
        "max_draft_len": B,  # shift_label layout: slot j drafts token j+1, B drafts per block
        "speculative_model": str(out / "engine" / "drafter"),
        "mask_token_id": dc.mask_token_id,
        "target_layer_ids": list(dc.target_layer_ids),
        "attention_backend": "VANILLA",
        "block_size": B,  # DSparkDecodingConfig.block_size: "Should equal max_draft_len"
        "markov_rank": 8,
        "markov_head_type": "vanilla",
    }
    # TensorRT-LLM reads the DSpark head switches from dflash_config (resolve_dspark_head_config)
    drafter_cfg = yaml.safe_load((out / "engine" / "drafter" / "config.json").read_text())
    assert drafter_cfg["dflash_config"]["projector_type"] == "dspark"
    assert drafter_cfg["dflash_config"]["markov_rank"] == 8


# ---- families and heads TensorRT-LLM does not run: refused by `check`, nothing written --------------------
@pytest.mark.parametrize(
    "drafter, says",
    [
        ("dflash2", "TensorRT-LLM has no DFlash 2 drafter"),
        ("domino", "TensorRT-LLM has no Domino drafter"),
        ("dspark-gated", "only the vanilla DSpark Markov head (this drafter's markov_head_type=gated)"),
        ("dspark-fill-in", "sample_from_anchor: false"),
    ],
)
def test_unsupported_drafters_are_refused_by_check_in_one_line(pair, tmp_path, drafter, says):
    r = cli(tmp_path, "check", **fields(pair, drafter))
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert r.output.startswith("error: backend=trtllm-pytorch: ") and says in r.output
    assert "backend: torch" in r.output
    if drafter == "dflash2":
        assert "vLLM runs it" in r.output
    if drafter == "domino":
        assert "SGLang runs it" in r.output
    assert not (tmp_path / "out").exists()


def test_the_torch_backend_still_takes_those_drafters(pair, tmp_path):
    r = cli(tmp_path, "check", **fields(pair, "domino", backend="torch", dtype="float32"))
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize(
    "over, says",
    [
        ({"ep_size": 2}, "ep_size=2: the target (qwen3) is dense"),
        ({"pp_size": 3}, "pp_size=3: above the target's 2 layers"),
    ],
)
def test_parallel_layouts_the_target_cannot_take_are_refused(pair, tmp_path, over, says):
    r = cli(tmp_path, "check", **fields(pair, **over))
    assert r.exit_code == 2 and r.output.count("\n") == 1 and says in r.output, r.output


def test_expert_parallel_passes_for_a_moe_target():
    cfg = BuildConfig(target="t", drafter="d", ep_size=4)
    trtllm.check_expert_parallel(cfg, SimpleNamespace(model_type="qwen3_moe", num_experts=64))
    with pytest.raises(ConfigError, match="ep_size=4"):
        trtllm.check_expert_parallel(cfg, SimpleNamespace(model_type="qwen3", num_experts=None))


# ---- quantized checkpoints -------------------------------------------------------------------------------
def test_fp8_build_points_at_the_quantized_target_and_keeps_the_bf16_drafter(pair, tmp_path):
    out, conf, log = build(
        tmp_path,
        **fields(pair, target_quant="fp8", drafter_quant="fp8", kv_cache="fp8", calib_prompts=2, eval_prompts=0),
    )
    assert conf["model"] == str(out / "quantized" / "target")
    assert (out / "quantized" / "target" / "hf_quant_config.json").is_file()  # what TensorRT-LLM reads
    assert conf["kv_cache_config"] == {"dtype": "fp8"}
    assert conf["speculative_config"]["speculative_model"] == str(out / "engine" / "drafter")
    assert not (out / "engine" / "drafter" / "hf_quant_config.json").exists()
    assert (out / "engine" / "drafter" / "model.safetensors").read_bytes() == (
        pair / "dflash" / "model.safetensors"
    ).read_bytes()
    assert "engine: drafter bf16 copy, not fp8: TensorRT-LLM" in log


# ---- parallelism, KV cache, CUDA graphs, attention --------------------------------------------------------
def test_parallel_kv_graph_and_attention_keys(pair, tmp_path):
    conf = llm_args(
        pair,
        tmp_path,
        tp_size=2,
        pp_size=2,
        ep_size=2,
        target_quant="fp8",  # an fp8 KV cache's calibrated scales ship in the quantized target
        kv_cache="fp8",
        cuda_graph_batch_sizes="4,1,2",
        attention_backend="flashinfer",
        sm="sm_100",
    )
    assert (conf["tensor_parallel_size"], conf["pipeline_parallel_size"], conf["moe_expert_parallel_size"]) == (
        2,
        2,
        2,
    )
    assert conf["kv_cache_config"] == {"dtype": "fp8"}
    assert conf["cuda_graph_config"] == {"batch_sizes": [1, 2, 4]}
    assert conf["attn_backend"] == "FLASHINFER"
    # the drafter's TRTLLM context attention pairs with TRTLLM attention only
    assert conf["speculative_config"]["attention_backend"] == "VANILLA"
    assert "moe_expert_parallel_size" not in llm_args(pair, tmp_path)
    assert "cuda_graph_config" not in llm_args(pair, tmp_path)


@pytest.mark.parametrize(
    "sm, backend, attn, draft_attn",
    [
        ("sm_90", "auto", "TRTLLM", "VANILLA"),
        ("sm_100", "auto", "TRTLLM", "TRTLLM"),  # Blackwell B200/GB200: generated FMHA for the drafter too
        ("sm_120", "auto", "TRTLLM", "VANILLA"),  # TensorRT-LLM's drafter TRTLLM kernels need SM100/SM103
        ("sm_100", "vanilla", "VANILLA", "VANILLA"),
    ],
)
def test_attention_backend_per_gpu_generation(pair, tmp_path, sm, backend, attn, draft_attn):
    conf = llm_args(pair, tmp_path, sm=sm, attention_backend=backend)
    assert (conf["attn_backend"], conf["speculative_config"]["attention_backend"]) == (attn, draft_attn)


def test_max_num_tokens_covers_a_full_batch_of_verify_blocks(pair, tmp_path):
    # max_batch sequences x (max_draft_len + 1) tokens per generation step, above TensorRT-LLM's 8192
    conf = llm_args(pair, tmp_path, max_batch=4096)
    assert conf["max_num_tokens"] == 4096 * B
    assert llm_args(pair, tmp_path, drafter="dspark", max_batch=4096)["max_num_tokens"] == 4096 * (B + 1)


def test_attention_backend_is_validated():
    with pytest.raises(ConfigError, match=r"attention_backend='flash'.*auto, trtllm, flashinfer, vanilla"):
        BuildConfig(target="t", drafter="d", attention_backend="flash")


def test_changing_attention_backend_rebuilds_the_engine_config(pair, tmp_path):
    build(tmp_path, **fields(pair, sm="sm_100"))
    _, conf, _ = build(tmp_path, **fields(pair, sm="sm_100", attention_backend="vanilla"))
    assert conf["attn_backend"] == "VANILLA"
