"""`dflash-trt build emit` (emit: [vllm, sglang]) for every drafter family, on tiny random pairs.

Neither engine runs here (no GPU; their packages are not dependencies), so the tests assert what their
loaders read, taken from their code (vllm 0.33.0 and sglang 0.5.23 wheels; paths relative to the package):
  * vLLM maps every tensor except lm_head to `model.<name>` and refuses a name with no module
    (model_executor/models/qwen3_dflash.py:851-884, qwen3_dspark.py:312-372), so the serving copy holds
    exactly the module names of DFlashQwen3Model (qwen3_dflash.py:412-495), DFlash2Qwen3Model
    (qwen3_dflash2.py:186-200, 260-264, 326-337) or Qwen3DSparkModel (qwen3_dspark.py:61-80, 176-224),
    and a draft vocabulary as lm_head.weight + d2t + top-level draft_vocab_size (qwen3_dflash.py:745-775);
  * DSpark's head fields are read top-level (qwen3_dspark.py:209-221; SGLang models/dspark.py:385-405,
    487-507) and sample_from_anchor too (vLLM v1/worker/gpu/spec_decode/dspark/speculator.py:49-51);
  * SGLang runs Domino as DFlashDraftModel + dflash_config.projector_type domino with
    pure_draft_prefix_len 1 (speculative/dflash_utils.py:727-790) and needs prefix_gru / embed_proj
    (models/dflash.py:987-998);
  * flags: vLLM engine/arg_utils.py and config/speculative.py (method names :69-83, num_speculative_tokens,
    quantization :435, enable_adaptive_verification :585); SGLang arg_groups/fields/{spec,model,parallel,
    schedule,exec_}.py (a field's flag is --name-with-dashes, arg_groups/arg_utils.py:290).
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from conftest import tiny_model_dir
from safetensors import safe_open

from dflash_trt.cli import main
from dflash_trt.config import DrafterConfig
from dflash_trt.deploy.build_config import BuildConfig
from dflash_trt.deploy.emit import check_emit
from dflash_trt.errors import ConfigError
from dflash_trt.families import domino, dspark
from dflash_trt.modeling.drafter import DFlashDrafter
from dflash_trt.modeling.target import TargetModel

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py

B = 4
D2 = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 16, "selector_top_k": 8}
SPARK = {**dspark.DEFAULTS, "markov_rank": 8, "markov_head_type": "vanilla", "confidence_head_alpha": 1.0}
DOMINO = {**domino.DEFAULTS, "emb_dim": 32, "gru_hidden_dim": 16, "pure_draft_prefix_len": 1}
# name -> (architecture, family fields, draft vocabulary size or None)
DRAFTERS = {
    "dflash": ("DFlashDraftModel", {}, None),
    "dflash-vocab": ("DFlashDraftModel", {}, 40),
    "dflash2": ("DFlash2DraftModel", D2, None),
    "dspark": ("DSparkDraftModel", SPARK, None),
    "dspark-gated": ("DSparkDraftModel", {**SPARK, "markov_head_type": "gated"}, None),
    "domino": ("DominoDraftModel", DOMINO, None),
    "domino-p0": ("DominoDraftModel", {**DOMINO, "pure_draft_prefix_len": 0}, None),
}
LAYER = "layers.0."
BACKBONE = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
    LAYER + n
    for n in (
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    )
}
EXTRA = {  # the family modules each engine builds (files cited in the module docstring)
    "dflash": set(),
    "dflash-vocab": set(),
    "dflash2": {
        *(
            f"{LAYER}{c}.{p}"
            for c in ("attention_conv", "mlp_conv")
            for p in ("base_kernel", "kernel_projection.weight")
        ),
        "candidate_selector.predecessor_codebook",
        "candidate_selector.successor_codebook",
        "candidate_selector.hidden_projection.weight",
    },
    "dspark": {
        "markov_head.markov_w1.weight",
        "markov_head.markov_w2.weight",
        "confidence_head.proj.weight",
        "confidence_head.proj.bias",
    },
    "domino": {"prefix_gru.weight_ih_l0", "prefix_gru.weight_hh_l0", "embed_proj.0.weight", "embed_proj.2.weight"},
}


def save_drafter(target: TargetModel, folder: Path, arch: str, fields: dict, vocab: int | None, seed: int = 1):
    cfg = DrafterConfig.for_target(target.config, num_layers=1, block_size=B)
    cfg = dataclasses.replace(cfg, architectures=[arch], family_fields=dict(fields), draft_vocab_size=vocab)
    torch.manual_seed(seed)
    d = DFlashDrafter(cfg)
    if vocab is not None:  # a spread-out draft vocabulary: draft ids differ from token ids
        d.draft_vocab.copy_(torch.arange(vocab) * 3 + 1)
    d.save_pretrained(folder)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("emit")
    tiny_model_dir(root / "target")
    target = TargetModel.from_pretrained(root / "target", dtype=torch.float32)
    for name, (arch, fields, vocab) in DRAFTERS.items():
        save_drafter(target, root / name, arch, fields, vocab)
    return root


def emit(tmp_path, root, drafter, engines=("vllm", "sglang"), **over):
    fields = {
        "target": str(root / "target"),
        "drafter": str(root / drafter),
        "max_batch": 4,
        "max_seq_len": 256,
        "emit": list(engines),
        "eval_prompts": 0,
        **over,
    }
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(fields))
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["build", "emit", "--config", str(tmp_path / "b.yaml"), "--out", str(out)])
    return r, out


def argv(script: Path) -> list[str]:
    """The exec'd command of a serve/*.sh script, split as the shell would."""
    text = script.read_text()
    return shlex.split(text[text.index("exec ") + 5 :].replace("\\\n", " "))


def flag(args: list[str], name: str, n: int = 1):
    i = args.index(name)
    return args[i + 1] if n == 1 else args[i + 1 : i + 1 + n]


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def family(name: str) -> str:
    return name.split("-")[0]


# ---- every family, both engines ------------------------------------------------------------------
@pytest.mark.parametrize("name", ["dflash", "dflash2", "dspark", "domino"])
def test_serving_copy_and_commands_per_family(pair, tmp_path, name):
    engines = ("sglang",) if name == "domino" else ("vllm", "sglang")
    r, out = emit(tmp_path, pair, name, engines, tp_size=2, cuda_graph_batch_sizes=[1, 2, 4])
    assert r.exit_code == 0, r.output
    manifest = json.loads((out / "build.json").read_text())
    assert manifest["stages"]["emit"]["status"] == "ran"
    assert manifest["stages"]["engine"]["status"] == "not run"  # `build emit` runs only what emit needs
    for engine in engines:
        copy = out / "serve" / engine / "drafter"
        cfg = json.loads((copy / "config.json").read_text())
        assert set(tensors(copy)) == BACKBONE | EXTRA[name]  # exactly what the engine's loader maps
        assert "draft_vocab_size" not in cfg and "draft_vocab_size" not in cfg["dflash_config"]
        assert cfg["block_size"] == B and cfg["model_type"] == "qwen3"
        args = argv(out / "serve" / f"{engine}.sh")
        assert (out / "serve" / f"{engine}.sh").stat().st_mode & 0o111
        if engine == "vllm":
            assert args[:2] == ["vllm", "serve"] and args[2] == str(pair / "target")
            spec = json.loads(flag(args, "--speculative-config"))
            assert spec["model"] == str(copy) and Path(spec["model"]).is_dir()
            method, n = ("dspark", B) if name == "dspark" else ("dflash", B - 1)
            assert (spec["method"], spec["num_speculative_tokens"]) == (method, n)
            assert "quantization" not in spec
            assert flag(args, "--tensor-parallel-size") == "2" and flag(args, "--max-num-seqs") == "4"
            assert flag(args, "--max-model-len") == "256"
            assert flag(args, "--cudagraph-capture-sizes", 3) == [str(b * (1 + n)) for b in (1, 2, 4)]
            assert "--quantization" not in args and "--kv-cache-dtype" not in args
        else:
            assert args[:3] == ["python", "-m", "sglang.launch_server"]
            assert flag(args, "--model-path") == str(pair / "target")
            assert flag(args, "--speculative-draft-model-path") == str(copy)
            algo = "DSPARK" if name == "dspark" else "DFLASH"
            assert flag(args, "--speculative-algorithm") == algo
            size_flag = "--speculative-dspark-block-size" if name == "dspark" else "--speculative-dflash-block-size"
            assert flag(args, size_flag) == str(B)
            assert flag(args, "--tp-size") == "2" and flag(args, "--max-running-requests") == "4"
            assert flag(args, "--context-length") == "256"
            assert flag(args, "--cuda-graph-bs-decode", 3) == ["1", "2", "4"]
            assert not any("quantization" in a for a in args)
        if name == "dspark":  # head fields top-level, every default explicit
            for k in ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov"):
                assert cfg[k] == cfg["dflash_config"][k]
            assert cfg["sample_from_anchor"] is True and cfg["confidence_head_with_markov"] is False
            # vLLM's parent DFlashSpeculator refuses dflash_config.sample_from_anchor=true
            # (v1/worker/gpu/spec_decode/dflash/speculator.py:80-88); SGLang reads it there too
            assert ("sample_from_anchor" in cfg["dflash_config"]) == (engine == "sglang")
            assert cfg["architectures"] == ["DSparkDraftModel"] and cfg["markov_rank"] == 8
        if name == "domino":
            assert cfg["architectures"] == ["DFlashDraftModel"]
            dc = cfg["dflash_config"]
            assert dc["projector_type"] == "domino" and dc["pure_draft_prefix_len"] == 1
            assert dc["shift_label"] is False and (dc["emb_dim"], dc["gru_hidden_dim"]) == (32, 16)
        if name == "dflash2":
            assert cfg["architectures"] == ["DFlash2DraftModel"]
            assert {k: cfg["dflash_config"][k] for k in D2} == D2  # read from dflash_config (qwen3_dflash2.py:248-255)


# ---- draft vocabulary --------------------------------------------------------------------------------
def test_draft_vocabulary_becomes_lm_head_rows_and_d2t_for_vllm_and_is_dropped_for_sglang(pair, tmp_path):
    r, out = emit(tmp_path, pair, "dflash-vocab")
    assert r.exit_code == 0, r.output
    ids = torch.arange(40) * 3 + 1
    with safe_open(str(pair / "target" / "model.safetensors"), framework="pt") as f:
        head = f.get_tensor("lm_head.weight" if "lm_head.weight" in f.keys() else "model.embed_tokens.weight")
    v = tensors(out / "serve" / "vllm" / "drafter")
    assert set(v) == BACKBONE | {"lm_head.weight", "d2t"}  # no draft_vocab: vLLM has no module for it
    assert torch.equal(v["lm_head.weight"], head[ids])
    assert v["d2t"].dtype == torch.int64 and torch.equal(torch.arange(40) + v["d2t"], ids)  # target = draft + d2t
    vcfg = json.loads((out / "serve" / "vllm" / "drafter" / "config.json").read_text())
    assert vcfg["draft_vocab_size"] == 40 and "draft_vocab_size" not in vcfg["dflash_config"]
    s = tensors(out / "serve" / "sglang" / "drafter")
    assert set(s) == BACKBONE  # SGLang has no draft vocabulary: full vocabulary through the target's head
    scfg = json.loads((out / "serve" / "sglang" / "drafter" / "config.json").read_text())
    assert "draft_vocab_size" not in json.dumps(scfg)
    src = tensors(pair / "dflash-vocab")
    assert all(torch.equal(s[k], src[k]) for k in BACKBONE)
    assert "dropped draft_vocab" in r.output and "added d2t, lm_head.weight" in r.output


# ---- refusals --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "drafter, engines, over, words",
    [
        ("domino", ("vllm",), {}, "emit=vllm: vLLM 0.33 has no Domino drafter"),
        ("dspark-gated", ("sglang", "vllm"), {}, "emit=vllm: vLLM 0.33 implements only the vanilla DSpark Markov head"),
        ("domino-p0", ("sglang",), {}, "emit=sglang: SGLang 0.5.23 runs Domino drafters with pure_draft_prefix_len=1"),
        ("dflash", ("sglang",), {"pp_size": 2}, "emit=sglang: pp_size=2"),
        ("dflash", ("vllm",), {"tp_size": 2, "ep_size": 4}, "emit=vllm: ep_size=4"),
        # SGLang 0.5.23's Qwen3 attention has no quant_config (srt/models/qwen3.py:223-230): its KV scales
        # would never load (found by scripts/interop_check.py)
        (
            "dflash",
            ("sglang",),
            {"target_quant": "fp8", "kv_cache": "fp8"},
            "emit=sglang: kv_cache=fp8: SGLang 0.5.23 never loads a qwen3 target's calibrated KV-cache scales",
        ),
    ],
)
def test_refused_in_check_with_one_line_and_nothing_built(pair, tmp_path, drafter, engines, over, words):
    r, out = emit(tmp_path, pair, drafter, engines, **over)
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and words in lines[0], r.output
    assert not out.exists()


def test_markov_rank_zero_is_refused_by_both_engines(pair):
    dc = DrafterConfig.load(pair / "dspark")
    dc = dataclasses.replace(dc, family_fields={**dc.family_fields, "markov_rank": 0})
    for engine in ("vllm", "sglang"):
        cfg = BuildConfig(target="t", drafter="d", emit=[engine])
        with pytest.raises(ConfigError, match=f"^emit={engine}: a DSpark drafter with markov_rank=0"):
            check_emit(cfg, dc)
    check_emit(BuildConfig(target="t", drafter="d"), dc)  # nothing emitted: nothing to refuse


# ---- DSpark options --------------------------------------------------------------------------------
def test_dspark_confidence_length_turns_on_vllm_adaptive_verification(pair, tmp_path):
    r, out = emit(tmp_path, pair, "dspark", ("vllm",), draft_length="confidence", draft_cutoff=0.3)
    assert r.exit_code == 0, r.output
    spec = json.loads(flag(argv(out / "serve" / "vllm.sh"), "--speculative-config"))
    assert spec["enable_adaptive_verification"] is True and spec["method"] == "dspark"


# ---- quantized exports -----------------------------------------------------------------------------
def test_quantized_exports_reference_the_quantized_folders(pair, tmp_path):
    # the pair's target is a Qwen3, whose KV scales SGLang never loads (test_refused_in_check...): the FP8
    # KV cache is emitted for vLLM alone, the rest for both
    (tmp_path / "kv").mkdir()
    r, out = emit(tmp_path / "kv", pair, "dflash", ("vllm",), target_quant="fp8", kv_cache="fp8", calib_prompts=2)
    assert r.exit_code == 0, r.output
    assert flag(argv(out / "serve" / "vllm.sh"), "--kv-cache-dtype") == "fp8"
    r, out = emit(tmp_path, pair, "dflash", target_quant="fp8", drafter_quant="fp8", calib_prompts=2)
    assert r.exit_code == 0, r.output
    v, s = argv(out / "serve" / "vllm.sh"), argv(out / "serve" / "sglang.sh")
    assert v[2] == str(out / "quantized" / "target") and flag(s, "--model-path") == str(out / "quantized" / "target")
    assert flag(v, "--quantization") == "modelopt" and "--kv-cache-dtype" not in v
    assert json.loads(flag(v, "--speculative-config"))["quantization"] == "modelopt"
    assert flag(s, "--quantization") == "modelopt_fp8" and "--kv-cache-dtype" not in s
    # SGLang's DFlashDraftModel.supports_quantization is False (srt/models/dflash.py:685): its fc is a plain
    # nn.Linear (:772) that would read fp8 codes as values, so SGLang gets the bf16 drafter, told so
    assert flag(s, "--speculative-draft-model-quantization") == "unquant"
    qsrc = tensors(out / "quantized" / "drafter")
    copy = out / "serve" / "vllm" / "drafter"
    assert set(tensors(copy)) == set(qsrc) and any(k.endswith(".weight_scale") for k in qsrc)
    cfg = json.loads((copy / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "modelopt"  # vLLM detects it from here
    assert json.loads((copy / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "FP8"
    bf16 = out / "serve" / "sglang" / "drafter"
    assert set(tensors(bf16)) == set(tensors(pair / "dflash")) and not (bf16 / "hf_quant_config.json").exists()
    assert "quantization_config" not in json.loads((bf16 / "config.json").read_text())
    assert "emit: serve/sglang.sh" in r.output and "drafter bf16 copy, not fp8: sglang's DFlash loader" in r.output


def test_bf16_drafter_of_a_quantized_target_opts_out_of_sglang_inheritance(pair, tmp_path):
    r, out = emit(tmp_path, pair, "dflash", target_quant="fp8", calib_prompts=2)
    assert r.exit_code == 0, r.output
    s, v = argv(out / "serve" / "sglang.sh"), argv(out / "serve" / "vllm.sh")
    assert flag(s, "--speculative-draft-model-quantization") == "unquant"
    assert "quantization" not in json.loads(flag(v, "--speculative-config"))
    assert json.loads(flag(v, "--speculative-config"))["model"] == str(out / "serve" / "vllm" / "drafter")
    assert "quantization_config" not in json.loads((out / "serve" / "vllm" / "drafter" / "config.json").read_text())


def test_a_rebuild_does_not_let_a_refused_engine_through(pair, tmp_path):
    r, out = emit(tmp_path, pair, "domino", ("sglang",))
    assert r.exit_code == 0, r.output
    before = (out / "serve" / "sglang.sh").read_text()
    r, out = emit(tmp_path, pair, "domino", ("vllm",))  # check runs on every build, cached or not
    assert r.exit_code == 2 and "emit=vllm: vLLM 0.33 has no Domino drafter" in r.output, r.output
    assert (out / "serve" / "sglang.sh").read_text() == before and not (out / "serve" / "vllm.sh").exists()
