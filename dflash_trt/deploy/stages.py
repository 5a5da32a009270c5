"""The build stages, one library function each; each writes only its own folder under the build dir.

Boundary: what a stage produces. Ordering, caching, the temp dir and build.json live in
deploy/run.py; the TensorRT-LLM specifics in deploy/trtllm.py, vLLM / SGLang in deploy/emit.py; the
quantized-vs-bf16 report in deploy/quant_eval.py; `check` in deploy/check.py; file helpers
(write_json, copy_tree) in deploy/files.py.

Every stage is `fn(ctx) -> info dict` and writes under `ctx.work` (the temp dir of this build),
while any path written *into* a file points at `ctx.final` (the out dir the temp dir becomes):

  check/summary.json        check        configs fit; params, memory per precision, KV-cache size
  quantized/{target,drafter} quantize    target: Model Optimizer's export; drafter: its layout (non-bf16 only)
  engine/                   engine       torch: target/ drafter/ tokenizer/ manifest.json;
                                         trtllm-pytorch: model.yaml (LLM API) + drafter/
  model_repo/               repo         filled Triton model repository
  serve/{vllm,sglang}.sh    emit         serving commands + the drafter copy each engine loads
  eval/eval.json            eval         tau and greedy agreement, quantized pair vs bf16 pair
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dflash_trt.api import encode, load_drafter, load_target, load_tokenizer
from dflash_trt.config import SamplingParams
from dflash_trt.decoding.loop import generate
from dflash_trt.deploy import emit, trtllm
from dflash_trt.deploy.build_config import BuildConfig
from dflash_trt.deploy.check import check, print_summary
from dflash_trt.deploy.files import copy_tree, link_or_copy, read_state, write_json
from dflash_trt.deploy.hf_checkpoint import save_quantized_checkpoint
from dflash_trt.deploy.modelopt_target import quantize_target
from dflash_trt.deploy.quant_eval import evaluate_quantized
from dflash_trt.deploy.quantize import calibrate_amax, quantize_state_dict, unquantized_modules
from dflash_trt.families.capabilities import caps_of
from dflash_trt.serving.repo import default_template_dir, default_values, fill_model_repo
from dflash_trt.train.prompts import load_prompts

# files of a model folder that are not weights: copied next to quantised weights so the folder
# stays a complete Hugging Face folder (tokenizer, chat template, generation defaults)
AUX_SUFFIXES = (".json", ".jinja", ".model", ".txt", ".py", ".tiktoken")
WEIGHT_FILES = ("config.json", "hf_quant_config.json")


@dataclass
class Context:
    cfg: BuildConfig
    work: Path  # temp dir this build writes into
    final: Path  # out dir it becomes on success; paths inside files point here
    dirs: dict[str, Path]  # resolved inputs: target, drafter, tokenizer
    echo: Callable[[str], None] = print
    progress: bool = True
    info: dict = field(default_factory=dict)  # stage name -> info of the stages run or cached so far

    def model_dir(self, which: str, final: bool = False) -> Path:
        """The folder the engine uses for 'target' / 'drafter': quantised if asked, else the input."""
        if self.cfg.quant_of(which) != "bf16":
            return (self.final if final else self.work) / "quantized" / which
        return self.dirs[which]


def copy_aux_files(src: Path, dst: Path) -> None:
    """Non-weight files of a HF folder (tokenizer, templates, generation config), not config.json."""
    for f in sorted(src.iterdir()):
        if f.is_file() and f.suffix in AUX_SUFFIXES and f.name not in WEIGHT_FILES and not (dst / f.name).exists():
            link_or_copy(f, dst / f.name)


# ---- check -------------------------------------------------------------------------------------
def stage_check(ctx: Context) -> dict:
    summary = check(ctx.cfg, ctx.dirs)
    write_json(ctx.work / "check" / "summary.json", summary)
    if ctx.progress:
        print_summary(summary)
    return {
        "target_params": summary["target"]["params"],
        "drafter_params": summary["drafter"]["params"],
        "block_size": summary["drafter"]["block_size"],
    }


# ---- quantize ----------------------------------------------------------------------------------
def _calibration_ids(ctx: Context, tok) -> list[list[int]]:
    prompts = load_prompts(ctx.cfg.calib_source, ctx.cfg.calib_prompts)
    chat = bool(getattr(tok, "chat_template", None))
    return [encode(tok, p, chat)[: min(ctx.cfg.calib_seq_len, ctx.cfg.max_seq_len)] for p in prompts]


def _quantize_drafter(ctx: Context, ids: list[list[int]]) -> dict:
    """The drafter through deploy/quantize.py (not a transformers model: modelopt's HF export does not take
    it). It sees target features only inside real DFlash decoding, so its calibration runs the pair: the
    target whole, in bf16 (never float32); kernels="torch": the Triton path computes context K/V inside one
    kernel, past the k_proj / v_proj / kv() hooks. Modules the family keeps in bf16 (CAPS.quant_exclude)
    and every other linear left unquantized are named in exclude_modules, as engines' loaders need."""
    cfg, kv = ctx.cfg, ctx.cfg.kv_quant
    target, _ = load_target(str(ctx.dirs["target"]), "bfloat16", progress=False, packed=False)
    drafter = load_drafter(target, str(ctx.dirs["drafter"]))
    amax, kv_amax = calibrate_amax(
        drafter,
        lambda p: generate(target, drafter, [p], SamplingParams(max_new_tokens=8), kernels="torch"),
        ids,
        progress=ctx.progress,
        kv=kv == "fp8",
    )
    src = ctx.dirs["drafter"]
    state = read_state(src)
    patterns = caps_of(drafter.config.family).quant_exclude
    qstate, hf_qc = quantize_state_dict(
        state, cfg.drafter_quant, exclude=patterns, act_amax=amax, kv_cache=kv, kv_amax=kv_amax
    )
    hf_qc["quantization"]["exclude_modules"] = unquantized_modules(qstate)
    dst = ctx.work / "quantized" / "drafter"
    save_quantized_checkpoint(dst, qstate, hf_qc, config=json.loads((src / "config.json").read_text()))
    copy_aux_files(src, dst)
    n = sum(1 for k in qstate if k.endswith(".weight_scale"))
    kv_n = sum(1 for k in qstate if k.endswith((".k_scale", ".v_scale"))) // 2
    ctx.echo(
        f"quantize: drafter -> {cfg.drafter_quant} ({n} linear layers, {len(ids)} calibration prompts"
        + (f", fp8 KV-cache scales of {kv_n} attention layers" if kv == "fp8" else "")
        + f"; kept bf16: {', '.join(hf_qc['quantization']['exclude_modules'])})"
    )
    return {
        "format": hf_qc["quantization"]["quant_algo"],
        "quantized_linears": n,
        "calibration_prompts": len(ids),
        "kv_cache_quant_algo": hf_qc["quantization"]["kv_cache_quant_algo"],
        "kv_scales": 2 * kv_n,
        "exclude_modules": hf_qc["quantization"]["exclude_modules"],
    }


def stage_quantize(ctx: Context) -> dict:
    """quantized/target (NVIDIA Model Optimizer's own export, deploy/modelopt_target.py: streamed, layer by
    layer) and quantized/drafter (deploy/quantize.py) for the models whose quant is not bf16; with an fp8 KV
    cache each carries its attention layers' k/v scales."""
    cfg = ctx.cfg
    ids = _calibration_ids(ctx, load_tokenizer(ctx.dirs["tokenizer"]))
    out = {}
    if cfg.target_quant != "bf16":
        src, dst = ctx.dirs["target"], ctx.work / "quantized" / "target"
        out["target"] = quantize_target(src, dst, cfg.target_quant, cfg.kv_quant, ids, cfg.awq, ctx.echo)
        copy_aux_files(src, dst)
        if ctx.dirs["tokenizer"] != src:
            copy_aux_files(ctx.dirs["tokenizer"], dst)
    if cfg.drafter_quant != "bf16":
        out["drafter"] = _quantize_drafter(ctx, ids)
    return out


# ---- engine --------------------------------------------------------------------------------------
def _torch_engine(ctx: Context) -> dict:
    """engine/{target,drafter,tokenizer} + manifest.json; quantised folders are kept quantised and
    dequantised on load (deploy/simulate.py). Loaded once here to prove the folder works."""
    eng = ctx.work / "engine"
    for which in ("target", "drafter"):
        copy_tree(ctx.model_dir(which), eng / which, files_only=True)
    tok = eng / "tokenizer"
    tok.mkdir(parents=True, exist_ok=True)
    copy_aux_files(ctx.dirs["tokenizer"], tok)
    target, _ = load_target(str(eng / "target"), ctx.cfg.dtype, progress=False)
    drafter = load_drafter(target, str(eng / "drafter"))
    manifest = {
        "backend": "torch",
        "dtype": ctx.cfg.dtype,
        "target": "target",
        "drafter": "drafter",
        "tokenizer": "tokenizer",
        "target_quant": ctx.cfg.target_quant,
        "drafter_quant": ctx.cfg.drafter_quant,
        "kv_cache": ctx.cfg.kv_cache,
        "block_size": drafter.config.block_size,
        "max_batch": ctx.cfg.max_batch,
        "max_seq_len": ctx.cfg.max_seq_len,
        "simulation": (
            (
                "fp8/nvfp4 weights are dequantised on load: weight rounding is exact, low-precision "
                "GEMMs and activation/KV quantisation are not simulated"
            )
            if ctx.cfg.quantized
            else None
        ),
    }
    write_json(eng / "manifest.json", manifest)
    ctx.echo(f"engine: torch engine folder (target {ctx.cfg.target_quant}, drafter {ctx.cfg.drafter_quant})")
    return {"block_size": drafter.config.block_size}


def stage_engine(ctx: Context) -> dict:
    if ctx.cfg.backend == "torch":
        return _torch_engine(ctx)
    return trtllm.write_llmapi_engine(ctx)


# ---- repo -----------------------------------------------------------------------------------------
# decoupled-only entry points, dropped when decoupled: false (which makes `dflash`, and so the ensemble, unary)
STREAMING_MODELS = ("dflash_bls",)


def stage_repo(ctx: Context) -> dict:
    """Fill the model_repo templates with this build's engine paths (pointing into the final out dir)."""
    cfg = ctx.cfg
    if cfg.backend == "trtllm-pytorch":
        return trtllm.write_llmapi_repo(ctx)
    eng = ctx.final / "engine"
    values = default_values(
        eng / "target",
        eng / "drafter",
        eng / "tokenizer",
        engine_backend=cfg.backend,
        max_batch=cfg.max_batch,
        max_seq_len=cfg.max_seq_len,
        dtype=cfg.dtype,
        triton_max_batch_size=cfg.triton_max_batch_size,
        unary_instance_count=cfg.instance_count,
        cpu_threads=cfg.cpu_threads,
        draft_cutoff=cfg.draft_cutoff,
        draft_length=cfg.draft_length,
        proposer=cfg.proposer,
        max_queue=cfg.max_queue,
        decoupled=cfg.decoupled,
        apply_chat_template=cfg.chat,
        chat_template_from=ctx.dirs["tokenizer"],
    )
    repo = fill_model_repo(default_template_dir(), ctx.work / "model_repo", values)
    if not cfg.decoupled:
        for name in STREAMING_MODELS:
            shutil.rmtree(repo / name, ignore_errors=True)
    models = sorted(p.name for p in repo.iterdir() if (p / "config.pbtxt").is_file())
    ctx.echo(f"repo: {len(models)} models ({', '.join(models)})")
    return {"models": models}


def stage_emit(ctx: Context) -> dict:
    return emit.emit_commands(ctx)


def stage_eval(ctx: Context) -> dict:
    return evaluate_quantized(ctx)
