"""Engine backends other than torch, and serving commands for other engines.

Boundary: the parts of a build that belong to NVIDIA TensorRT-LLM, vLLM or SGLang: refusing early
when TensorRT-LLM cannot run here, the `trtllm-build` calls, the LLM-API `model.yaml` for Triton's
`llmapi` model (TensorRT-LLM >= 1.3 has DFlash in its PyTorch backend), and the vLLM / SGLang
command lines. Flags and keys are the documented ones:
  trtllm-build  --checkpoint_dir --output_dir --max_batch_size --max_seq_len --max_num_tokens
                --gather_generation_logits --speculative_decoding_mode draft_tokens_external
                --max_draft_len --model_cls_file --model_cls_name  (TensorRT-LLM 1.2 CLI)
  model.yaml    LLM() arguments; speculative_config = DFlashDecodingConfig {decoding_type: DFlash,
                speculative_model, max_draft_len, mask_token_id, target_layer_ids}; triton_config
  vLLM          vllm serve T --speculative-config '{"method": "dflash", "model": D,
                "num_speculative_tokens": B-1}'
  SGLang        python -m sglang.launch_server --model-path T --speculative-algorithm DFLASH
                --speculative-draft-model-path D --speculative-num-draft-tokens B
None of them runs on this CPU-only machine; what can be checked here (files, flags, refusals) is tested.
"""

from __future__ import annotations

import importlib.util
import json
import shlex
import shutil
import subprocess
from importlib import metadata
from pathlib import Path

import torch
import yaml

from dflash_trt.config import DrafterConfig
from dflash_trt.deploy.build_config import BuildConfig
from dflash_trt.deploy.files import copy_tree, write_json
from dflash_trt.errors import DFlashError

DOCKER_HINT = (
    "run it on a GPU host in the NGC image: `docker build -t dflash-trt .` then `docker run --gpus all "
    "-v $PWD:/work dflash-trt dflash-trt build --config /work/build.yaml --out /work/out` "
    "(or use backend: torch here)"
)
DRAFTER_NETWORK = "trtllm_model.py"  # DFlashDraftModel network for trtllm-build --model_cls_file


def _trtllm_version() -> str | None:
    for name in ("tensorrt_llm", "tensorrt-llm"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def trtllm_preflight(cfg: BuildConfig) -> None:
    """Raise before anything is written when a TensorRT engine build cannot run here."""
    missing = []
    if importlib.util.find_spec("tensorrt_llm") is None:
        missing.append("the tensorrt_llm package (TensorRT-LLM 1.2.x)")
    else:
        v = _trtllm_version() or "unknown"
        if not v.startswith("1.2"):
            missing.append(
                f"TensorRT-LLM 1.2.x (found {v}; 1.2 is the last line that builds TensorRT engines, "
                f">= 1.3 is served with backend: trtllm-pytorch)"
            )
    if not torch.cuda.is_available():
        missing.append("a CUDA GPU")
    if shutil.which("trtllm-build") is None:
        missing.append("the trtllm-build command")
    net = Path(cfg.plugins_dir) / DRAFTER_NETWORK if cfg.plugins_dir else None
    if net is None or not net.is_file():
        missing.append(
            f"the DFlash drafter network for trtllm-build (plugins_dir with {DRAFTER_NETWORK} and the "
            f"compiled plugins; `dflash-trt plugins compile`)"
        )
    if missing:
        raise DFlashError(f"backend=tensorrt-llm needs {'; '.join(missing)}. Nothing was written; {DOCKER_HINT}")


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise DFlashError(f"{what}: trtllm-build failed (exit {proc.returncode}): {tail}")


def build_trtllm_engines(ctx) -> dict:
    """trtllm-build on the converted checkpoints. Target: whole verify blocks in one step
    (draft_tokens_external, max_draft_len B-1) with logits for every block position. Drafter: the
    DFlashDraftModel network from plugins_dir, whose attention uses the DFlash plugins."""
    cfg, block = ctx.cfg, ctx.info["check"]["block_size"]
    ckpt, eng = ctx.work / "trtllm_ckpt", ctx.work / "engine"
    common = [
        "--max_batch_size",
        str(cfg.max_batch),
        "--max_seq_len",
        str(cfg.max_seq_len),
        "--max_num_tokens",
        str(cfg.max_batch * block),
        "--workers",
        str(cfg.tp_size),
    ]
    _run(
        [
            "trtllm-build",
            "--checkpoint_dir",
            str(ckpt / "target"),
            "--output_dir",
            str(eng / "target"),
            *common,
            "--gather_generation_logits",
            "--speculative_decoding_mode",
            "draft_tokens_external",
            "--max_draft_len",
            str(block - 1),
        ],
        "target engine",
    )
    _run(
        [
            "trtllm-build",
            "--checkpoint_dir",
            str(ckpt / "drafter"),
            "--output_dir",
            str(eng / "drafter"),
            *common,
            "--model_cls_file",
            str(Path(cfg.plugins_dir) / DRAFTER_NETWORK),
            "--model_cls_name",
            "DFlashDraftModel",
        ],
        "drafter engine",
    )
    write_json(
        eng / "manifest.json",
        {
            "backend": "tensorrt-llm",
            "tensorrt_llm": _trtllm_version(),
            "target": "target",
            "drafter": "drafter",
            "block_size": block,
            "max_batch": cfg.max_batch,
            "max_seq_len": cfg.max_seq_len,
            "sm": cfg.sm,
            "plugins_dir": str(Path(cfg.plugins_dir).resolve()),
        },
    )
    ctx.echo("engine: TensorRT-LLM engines built")
    return {"block_size": block}


# ---- trtllm-pytorch: LLM-API model.yaml --------------------------------------------------------
def llmapi_config(ctx) -> dict:
    """LLM() arguments for Triton's llmapi model with DFlash speculative decoding."""
    cfg = ctx.cfg
    dc = DrafterConfig.load(ctx.dirs["drafter"])
    spec = {
        "decoding_type": "DFlash",
        "speculative_model": str(ctx.final / "engine" / "drafter"),
        "max_draft_len": dc.block_size - 1,
        "mask_token_id": dc.mask_token_id,
        "target_layer_ids": list(dc.target_layer_ids),
    }
    out = {
        "model": str(ctx.model_dir("target", final=True)),
        "tokenizer": str(ctx.dirs["tokenizer"]),
        "backend": "pytorch",
        "tensor_parallel_size": cfg.tp_size,
        "pipeline_parallel_size": 1,
        "max_batch_size": cfg.max_batch,
        "max_seq_len": cfg.max_seq_len,
        "speculative_config": spec,
    }
    if cfg.kv_cache == "fp8":
        out["kv_cache_config"] = {"dtype": "fp8"}
    return out


def write_llmapi_engine(ctx) -> dict:
    """engine/model.yaml + engine/drafter (the z-lab drafter, which TensorRT-LLM's DFlash loads)."""
    eng = ctx.work / "engine"
    copy_tree(ctx.dirs["drafter"], eng / "drafter", files_only=True)
    conf = llmapi_config(ctx)
    eng.mkdir(parents=True, exist_ok=True)
    (eng / "model.yaml").write_text(
        "# TensorRT-LLM (>= 1.3, PyTorch backend) LLM-API config, written by dflash-trt "
        "build.\n# Keys are tensorrt_llm.LLM() arguments; see Triton's llmapi model.\n"
        + yaml.safe_dump(conf, sort_keys=False)
    )
    if ctx.cfg.drafter_quant != "bf16":
        ctx.echo(
            "engine: note: drafter_quant applies to the torch / tensorrt-llm backends; TensorRT-LLM's "
            "DFlash loads the z-lab (bf16) drafter"
        )
    ctx.echo("engine: model.yaml for Triton's llmapi model (no engine build needed)")
    return {"block_size": conf["speculative_config"]["max_draft_len"] + 1}


def write_llmapi_repo(ctx) -> dict:
    """model_repo/tensorrt_llm/1/model.yaml: the engine's LLM() arguments plus Triton's triton_config."""
    repo = ctx.work / "model_repo" / "tensorrt_llm"
    (repo / "1").mkdir(parents=True, exist_ok=True)
    text = (ctx.work / "engine" / "model.yaml").read_text()
    # the llmapi model.py does not batch requests itself (its template sets max_batch_size 0);
    # the LLM engine batches in flight up to the max_batch_size above
    triton = {"triton_config": {"max_batch_size": 0, "decoupled": ctx.cfg.decoupled}}
    (repo / "1" / "model.yaml").write_text(text + yaml.safe_dump(triton, sort_keys=False))
    (repo.parent / "README.md").write_text(
        "Triton llmapi model repository (TensorRT-LLM >= 1.3).\n\nAdd model.py and config.pbtxt from TensorRT-LLM's "
        "triton_backend/all_models/llmapi/tensorrt_llm/ (same release as the container) next to 1/model.yaml, then:\n\n"
        f"    tritonserver --model-repository {ctx.final / 'model_repo'}\n"
    )
    return {"models": ["tensorrt_llm"]}


# ---- vLLM / SGLang -----------------------------------------------------------------------------
def serve_commands(ctx) -> dict[str, str]:
    cfg = ctx.cfg
    block = DrafterConfig.load(ctx.dirs["drafter"]).block_size
    target, drafter, tok = (
        str(ctx.model_dir("target", final=True)),
        str(ctx.dirs["drafter"]),
        str(ctx.dirs["tokenizer"]),
    )
    q = shlex.quote
    spec = json.dumps({"method": "dflash", "model": drafter, "num_speculative_tokens": block - 1})
    vllm = [
        f"vllm serve {q(target)}",
        f"--tokenizer {q(tok)}",
        f"--speculative-config {q(spec)}",
        f"--tensor-parallel-size {cfg.tp_size}",
        f"--max-num-seqs {cfg.max_batch}",
        f"--max-model-len {cfg.max_seq_len}",
    ] + (["--kv-cache-dtype fp8"] if cfg.kv_cache == "fp8" else [])
    sglang = [
        f"python -m sglang.launch_server --model-path {q(target)}",
        f"--tokenizer-path {q(tok)}",
        "--speculative-algorithm DFLASH",
        f"--speculative-draft-model-path {q(drafter)}",
        f"--speculative-num-draft-tokens {block}",
        f"--tp-size {cfg.tp_size}",
        f"--max-running-requests {cfg.max_batch}",
        f"--context-length {cfg.max_seq_len}",
    ] + (["--kv-cache-dtype fp8_e4m3"] if cfg.kv_cache == "fp8" else [])
    return {"vllm": " \\\n  ".join(vllm), "sglang": " \\\n  ".join(sglang)}


def emit_commands(ctx) -> dict:
    """serve/<engine>.sh: the exact command line serving this pair with the same drafter folder."""
    cmds = serve_commands(ctx)
    out = ctx.work / "serve"
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for name in ctx.cfg.emit:
        f = out / f"{name}.sh"
        f.write_text(
            f"#!/usr/bin/env bash\n# {name} serving of this DFlash pair (written by dflash-trt build)\n"
            f"set -euo pipefail\nexec {cmds[name]}\n"
        )
        f.chmod(0o755)
        written[name] = cmds[name]
        ctx.echo(f"emit: serve/{name}.sh")
    return {"commands": written}
