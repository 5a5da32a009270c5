"""The `trtllm-pytorch` backend: TensorRT-LLM (>= 1.3, PyTorch backend) served by Triton's `llmapi` model.

Boundary: what TensorRT-LLM is given and what it refuses. `check_trtllm` (called by the check stage,
so nothing is built) refuses the drafters and parallel layouts TensorRT-LLM cannot run;
`llmapi_config` is the tensorrt_llm.LLM() arguments; `write_llmapi_engine` writes engine/model.yaml
and engine/drafter; `write_llmapi_repo` writes model_repo/tensorrt_llm/1/model.yaml (the same
arguments plus Triton's triton_config) and a README naming the files Triton's llmapi model needs.
TensorRT-LLM's TensorRT engine backend (trtllm-build) is gone upstream since July 2026; nothing here
builds engines. TensorRT-LLM does not run on this CPU-only machine: what can be checked (files,
keys, refusals) is tested (tests/test_deploy_trtllm.py, which cites the TensorRT-LLM source of each key).

Keys (NVIDIA/TensorRT-LLM tensorrt_llm/llmapi/llm_args.py): speculative_config is DFlashDecodingConfig
{decoding_type: DFlash, max_draft_len, speculative_model, mask_token_id, target_layer_ids,
attention_backend} or DSparkDecodingConfig {decoding_type: DSpark, + block_size, markov_rank,
markov_head_type}; tensor_parallel_size, pipeline_parallel_size, moe_expert_parallel_size;
kv_cache_config.dtype; cuda_graph_config.batch_sizes; attn_backend; max_batch_size, max_seq_len,
max_num_tokens.
"""

from __future__ import annotations

import yaml

from dflash_trt.config import DrafterConfig
from dflash_trt.decoding.proposers import AUTO
from dflash_trt.deploy.files import copy_tree
from dflash_trt.errors import ConfigError
from dflash_trt.families.capabilities import caps_of, engine_of, refusal

# build.yaml attention_backend -> TensorRT-LLM attn_backend (TorchLlmArgs.attn_backend: VANILLA |
# TRTLLM | FLASHINFER; TRTLLM is its default and the backend its docs recommend for production)
ATTN_BACKEND = {"auto": "TRTLLM", "trtllm": "TRTLLM", "flashinfer": "FLASHINFER", "vanilla": "VANILLA"}
# the drafter's pooled-context attention (DFlash/DSparkDecodingConfig.attention_backend): TRTLLM's
# generated FMHA kernels need SM100/SM103 (B200/GB200/B300); everywhere else VANILLA (FlashAttention)
DRAFT_TRTLLM_SMS = ("sm_100",)
# TensorRT-LLM's max_num_tokens default (BaseLlmArgs.max_num_tokens); raised when verify blocks need more
TRTLLM_MAX_NUM_TOKENS = 8192
ENGINE = "trtllm-pytorch"  # this backend's name in the families' capability declarations (families/*.py CAPS)
# config.json fields that mark a mixture-of-experts target (Qwen-MoE / Mixtral / DeepSeek spellings)
MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")


def is_moe(tc) -> bool:
    return any((getattr(tc, f, None) or 0) > 1 for f in MOE_FIELDS)


def check_expert_parallel(cfg, tc) -> None:
    """ep_size splits a MoE target's experts; a dense target has none to split."""
    if cfg.ep_size > 1 and not is_moe(tc):
        raise ConfigError(
            f"ep_size={cfg.ep_size}: the target ({tc.model_type}) is dense, expert parallelism needs a "
            f"mixture-of-experts target; set ep_size: 1 (use tp_size / pp_size to split a dense model)"
        )


def check_trtllm(cfg, tc, dc: DrafterConfig) -> None:
    """What TensorRT-LLM cannot run, refused at `check` (one line naming the field and the fix)."""
    why = refusal(dc.family, ENGINE, dc.family_fields, cfg.drafter_quant)  # the family's own declaration
    if why:
        raise ConfigError(f"backend={ENGINE}: {why}")
    if cfg.pp_size > tc.num_hidden_layers:
        raise ConfigError(
            f"pp_size={cfg.pp_size}: above the target's {tc.num_hidden_layers} layers (each pipeline stage "
            f"needs at least one); lower pp_size"
        )


def draft_lengths(dc: DrafterConfig) -> tuple[int, int | None]:
    """(max_draft_len, DSpark block_size) of a drafter with block size B: the family's serving draft count
    (CAPS.drafts: DFlash B-1, slots 1..B-1 after the anchor; DSpark's shift_label layout B, slot j predicts
    token j+1); TensorRT-LLM wants DSpark's block_size equal to max_draft_len (DSparkDecodingConfig)."""
    k = caps_of(dc.family).drafts(dc)
    return k, (k if engine_of(dc.family, ENGINE).layout == "DSpark" else None)


def speculative_config(ctx, dc: DrafterConfig) -> dict:
    cfg = ctx.cfg
    k, block = draft_lengths(dc)
    spec = {
        "decoding_type": engine_of(dc.family, ENGINE).layout,  # DFlash | DSpark
        "max_draft_len": k,
        "speculative_model": str(ctx.final / "engine" / "drafter"),
        "mask_token_id": dc.mask_token_id,
        "target_layer_ids": list(dc.target_layer_ids),
        "attention_backend": (
            "TRTLLM" if cfg.sm in DRAFT_TRTLLM_SMS and ATTN_BACKEND[cfg.attention_backend] == "TRTLLM" else "VANILLA"
        ),
    }
    if block:  # stated, not left to TensorRT-LLM's DeepSpec-named config lookups (dspark_block_size, ...)
        spec.update(
            block_size=block,
            markov_rank=dc.family_fields["markov_rank"],
            markov_head_type=dc.family_fields["markov_head_type"],
        )
    return spec


def llmapi_config(ctx) -> dict:
    """LLM() arguments for Triton's llmapi model with DFlash / DSpark speculative decoding."""
    cfg = ctx.cfg
    dc = DrafterConfig.load(ctx.dirs["drafter"])
    spec = speculative_config(ctx, dc)
    out = {
        "model": str(ctx.model_dir("target", final=True)),  # quantized/target for fp8 / nvfp4
        "tokenizer": str(ctx.dirs["tokenizer"]),
        "backend": "pytorch",  # as Triton's llmapi model.yaml template writes it (deprecated, still accepted)
        "tensor_parallel_size": cfg.tp_size,
        "pipeline_parallel_size": cfg.pp_size,
        "max_batch_size": cfg.max_batch,
        "max_seq_len": cfg.max_seq_len,
        # a generation step feeds max_draft_len + 1 tokens per sequence (tokens_per_gen_step)
        "max_num_tokens": max(TRTLLM_MAX_NUM_TOKENS, cfg.max_batch * (spec["max_draft_len"] + 1)),
        "kv_cache_config": {"dtype": "fp8" if cfg.kv_cache == "fp8" else "auto"},
        "attn_backend": ATTN_BACKEND[cfg.attention_backend],
        "speculative_config": spec,
    }
    if cfg.ep_size > 1:
        out["moe_expert_parallel_size"] = cfg.ep_size
    if cfg.cuda_graph_batch_sizes:
        out["cuda_graph_config"] = {"batch_sizes": list(cfg.cuda_graph_batch_sizes)}
    if cfg.dtype != "auto":
        out["dtype"] = cfg.dtype
    return out


def write_llmapi_engine(ctx) -> dict:
    """engine/model.yaml + engine/drafter (the bf16 drafter, which TensorRT-LLM's DFlash / DSpark loads)."""
    cfg = ctx.cfg
    eng = ctx.work / "engine"
    copy_tree(ctx.dirs["drafter"], eng / "drafter", files_only=True)
    conf = llmapi_config(ctx)
    eng.mkdir(parents=True, exist_ok=True)
    (eng / "model.yaml").write_text(
        "# TensorRT-LLM (>= 1.3, PyTorch backend) LLM-API config, written by dflash-trt "
        "build.\n# Keys are tensorrt_llm.LLM() arguments; see Triton's llmapi model.\n"
        + yaml.safe_dump(conf, sort_keys=False)
    )
    dc = DrafterConfig.load(ctx.dirs["drafter"])
    sup = engine_of(dc.family, ENGINE)
    if cfg.drafter_quant != "bf16" and not sup.quantized_drafter:
        ctx.echo(
            f"engine: drafter bf16 copy, not {cfg.drafter_quant}: TensorRT-LLM's DFlash/DSpark drafter projects "
            f"context K/V with the raw qkv_proj weights and a plain nn.Linear fc"
        )
    if dc.draft_vocab_size is not None and not sup.draft_vocab:
        # DFlashForCausalLM.load_weights(allow_partial_loading=True) ignores draft_vocab and uses the target's
        # full LM head: the drafter drafts over the whole vocabulary there (its accepted drafts stay exact)
        ctx.echo(
            f"engine: draft vocabulary ({dc.draft_vocab_size} tokens) dropped: TensorRT-LLM drafts over the "
            f"target's full vocabulary (DFlashForCausalLM loads the target's LM head)"
        )
    if cfg.draft_cutoff > 0 or cfg.draft_length != "block" or cfg.proposer not in ("dflash", AUTO):
        ctx.echo(
            "engine: note: draft_cutoff / draft_length / proposer are dflash-trt engine settings; "
            "TensorRT-LLM proposes and verifies the whole block"
        )
    ctx.echo(f"engine: model.yaml ({conf['speculative_config']['decoding_type']}) for Triton's llmapi model")
    spec = conf["speculative_config"]
    return {"decoding_type": spec["decoding_type"], "max_draft_len": spec["max_draft_len"]}


# files of TensorRT-LLM's triton_backend/all_models/llmapi/tensorrt_llm/ that Triton's llmapi model needs
# beside our 1/model.yaml (model.py imports helpers.py from its own folder)
LLMAPI_FILES = ("config.pbtxt", "1/model.py", "1/helpers.py")
VERSION_PY = "\"import importlib.metadata as m; print(m.version('tensorrt_llm'))\""
LLMAPI_SRC = "https://raw.githubusercontent.com/NVIDIA/TensorRT-LLM/v$V/triton_backend/all_models/llmapi/tensorrt_llm"


def _mounts(ctx, conf: dict) -> list[str]:
    """Folders model.yaml names (absolute), outermost first: mounted at the same path in the container."""
    paths = sorted({str(ctx.final), conf["model"], conf["tokenizer"]}, key=len)
    out: list[str] = []
    for p in paths:
        if not any(p == q or p.startswith(q.rstrip("/") + "/") for q in out):
            out.append(p)
    return out


def _readme(ctx, conf: dict) -> str:
    repo = ctx.final / "model_repo"
    mounts = " ".join(f"-v {p}:{p}" for p in _mounts(ctx, conf))
    fetch = "\n".join(f"    curl -fsSL -o {repo}/tensorrt_llm/{f} {LLMAPI_SRC}/{f}" for f in LLMAPI_FILES)
    return (
        "Triton llmapi model repository (TensorRT-LLM >= 1.3, PyTorch backend), written by dflash-trt build.\n\n"
        "tensorrt_llm/ needs these files; dflash-trt writes 1/model.yaml, the rest come from TensorRT-LLM's\n"
        "triton_backend/all_models/llmapi/tensorrt_llm/ at the container's TensorRT-LLM version:\n\n"
        "    tensorrt_llm/config.pbtxt     (TensorRT-LLM)\n"
        "    tensorrt_llm/1/model.py       (TensorRT-LLM)\n"
        "    tensorrt_llm/1/helpers.py     (TensorRT-LLM; model.py imports it)\n"
        "    tensorrt_llm/1/model.yaml     (dflash-trt: LLM() arguments + triton_config)\n\n"
        "TRITON_TAG = an NGC tritonserver release whose trtllm-python-py3 image has TensorRT-LLM >= 1.3 (the\n"
        "Triton Release Compatibility Matrix lists none up to 26.07, which ship 1.2.1). Fetch the files of the\n"
        "container's TensorRT-LLM version, then serve:\n\n"
        "    IMAGE=nvcr.io/nvidia/tritonserver:${TRITON_TAG}-trtllm-python-py3\n"
        f"    V=$(docker run --rm $IMAGE python3 -c {VERSION_PY})\n{fetch}\n\n"
        f"    docker run --rm --gpus all --network host --ipc=host {mounts} \\\n"
        "      $IMAGE \\\n"
        f"      tritonserver --model-repository {repo}\n\n"
        "The paths in 1/model.yaml are absolute: the -v flags mount each at the same path.\n"
    )


def write_llmapi_repo(ctx) -> dict:
    """model_repo/tensorrt_llm/1/model.yaml: the engine's LLM() arguments plus Triton's triton_config."""
    repo = ctx.work / "model_repo" / "tensorrt_llm"
    (repo / "1").mkdir(parents=True, exist_ok=True)
    text = (ctx.work / "engine" / "model.yaml").read_text()
    conf = yaml.safe_load(text)
    # the llmapi model.py does not batch requests itself (its template sets max_batch_size 0);
    # the LLM engine batches in flight up to the max_batch_size above
    triton = {"triton_config": {"max_batch_size": 0, "decoupled": ctx.cfg.decoupled}}
    (repo / "1" / "model.yaml").write_text(text + yaml.safe_dump(triton, sort_keys=False))
    (repo.parent / "README.md").write_text(_readme(ctx, conf))
    ctx.echo("repo: tensorrt_llm/1/model.yaml (add config.pbtxt, 1/model.py, 1/helpers.py: model_repo/README.md)")
    return {"models": ["tensorrt_llm"]}
