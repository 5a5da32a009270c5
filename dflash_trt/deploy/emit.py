"""Serving this pair in vLLM 0.33 / SGLang 0.5.23 (`emit: [vllm, sglang]`): the rules, the commands, the files.

Boundary: which drafter families each engine runs (`check_emit`, called by the `check` stage so a pair
an engine cannot serve is refused before anything is built), and serve/<engine>.sh + the drafter copy it
loads, serve/<engine>/drafter/ (its layout: deploy/emit_layout.py). Neither engine runs on a CPU-only
machine: the flags and layouts are taken from their code, file and line cited where each is used
(paths relative to the installed `vllm` / `sglang` packages).

  family    vLLM --speculative-config                         SGLang --speculative-algorithm
  DFlash    method dflash, num_speculative_tokens B-1          DFLASH, --speculative-dflash-block-size B
  DFlash 2  method dflash (architecture DFlash2DraftModel)    DFLASH (architecture DFlash2DraftModel)
  DSpark    method dspark, num_speculative_tokens B           DSPARK, --speculative-dspark-block-size B
  Domino    refused: vLLM has none                            DFLASH (DFlashDraftModel + projector_type domino)

(B = the drafter's block_size; DSpark with sample_from_anchor false drafts one fewer, B-1.)
"""

from __future__ import annotations

import json
import shlex

from dflash_trt.config import DrafterConfig
from dflash_trt.deploy.emit_layout import write_serving_drafter
from dflash_trt.errors import ConfigError
from dflash_trt.families.capabilities import caps_of, drafter_copy, engine_of, refusal

# vLLM detects Model Optimizer checkpoints as these (layers/quantization/modelopt.py:453-459, 776-782);
# an explicit --quantization must equal the detected name (config/model.py:1448-1456)
VLLM_QUANT = {"fp8": "modelopt", "nvfp4": "modelopt_fp4"}
# SGLang's names for the same checkpoints (configs/model_config.py:1838-1869, arg_groups/choices.py:42-44)
SGLANG_QUANT = {"fp8": "modelopt_fp8", "nvfp4": "modelopt_fp4"}
VLLM_KV = {"fp8": "fp8"}  # config/cache.py:44-56 CacheDType
SGLANG_KV = {"fp8": "fp8_e4m3"}  # arg_groups/fields/model.py:197-215 --kv-cache-dtype choices


# target model types whose SGLang 0.5.23 attention is built without quant_config, so a checkpoint's
# calibrated k_scale / v_scale are never loaded and an FP8 KV cache runs at scale 1.0 (srt/models/qwen3.py
# RadixAttention(...) at :223-230; qwen2.py:221 and llama.py:239 pass quant_config)
SGLANG_NO_KV_SCALES = ("qwen3",)


def _refusal(cfg, dc: DrafterConfig, engine: str, target_type: str | None) -> str | None:
    """Why `engine` cannot serve this drafter with this build config (None: it can): the family's own
    declaration (families/*.py CAPS) first, then the engines' parallel-layout and KV-scale rules."""
    why = refusal(dc.family, engine, dc.family_fields, cfg.drafter_quant)
    if why:
        return why
    if engine == "sglang" and cfg.kv_cache != "bf16" and target_type in SGLANG_NO_KV_SCALES:
        return (
            f"kv_cache={cfg.kv_cache}: SGLang 0.5.23 never loads a {target_type} target's calibrated KV-cache "
            f"scales (its attention has no quant_config), so the cache would run uncalibrated; use kv_cache: bf16"
        )
    if engine == "vllm" and cfg.ep_size > 1 and cfg.ep_size != cfg.tp_size:
        # --enable-expert-parallel spreads the MoE experts over the tp ranks (config/parallel.py:190-191)
        return (
            f"ep_size={cfg.ep_size}: vLLM's expert parallelism spans the tp_size={cfg.tp_size} ranks; "
            f"set ep_size to 1 or {cfg.tp_size}"
        )
    if engine == "sglang" and cfg.pp_size > 1:  # arg_groups/speculative_hook.py:319-322 (DFLASH), 713-718 (DSPARK)
        return f"pp_size={cfg.pp_size}: SGLang 0.5.23 serves DFlash / DSpark drafters with pp_size 1 only; use tp_size"
    return None


def check_emit(cfg, dc: DrafterConfig, target_type: str | None = None) -> None:
    """One ConfigError line for the first engine in `cfg.emit` that cannot serve this drafter (and, when
    `target_type` (config.json model_type) is given, this target with this build's KV cache)."""
    for engine in cfg.emit:
        why = _refusal(cfg, dc, engine, target_type)
        if why:
            raise ConfigError(f"emit={engine}: {why} (or drop {engine} from emit)")


def num_drafts(dc: DrafterConfig) -> int:
    """Draft tokens per step in vLLM, SGLang and TensorRT-LLM, as the family declares (CAPS.drafts): B-1
    for a block of the last verified token plus B-1 masks (vLLM qwen3_dflash2.py:256, SGLang
    speculative_hook.py:368-386); DSpark with sample_from_anchor drafts from all B positions."""
    return caps_of(dc.family).drafts(dc)


def _q(v) -> str:
    return shlex.quote(str(v))


def vllm_command(cfg, dc: DrafterConfig, target, drafter, tokenizer) -> list[str]:
    n = num_drafts(dc)
    method = engine_of(dc.family, "vllm").layout
    spec = {"method": method, "model": str(drafter), "num_speculative_tokens": n}
    if drafter_copy(dc.family, "vllm", cfg.drafter_quant) == "quantized":  # config/speculative.py:435-438
        spec["quantization"] = VLLM_QUANT[cfg.drafter_quant]
    if method == "dspark" and cfg.draft_length == "confidence":
        spec["enable_adaptive_verification"] = True  # the confidence head sizes the verify budget (:585-587)
    cmd = [
        f"vllm serve {_q(target)}",  # flags: engine/arg_utils.py
        f"--tokenizer {_q(tokenizer)}",
        f"--speculative-config {_q(json.dumps(spec, sort_keys=True))}",
        f"--tensor-parallel-size {cfg.tp_size}",
        f"--max-num-seqs {cfg.max_batch}",
        f"--max-model-len {cfg.max_seq_len}",
    ]
    if cfg.pp_size > 1:
        cmd.append(f"--pipeline-parallel-size {cfg.pp_size}")
    if cfg.ep_size > 1:
        cmd.append("--enable-expert-parallel")
    if cfg.dtype != "auto":
        cmd.append(f"--dtype {cfg.dtype}")
    if cfg.target_quant != "bf16":
        cmd.append(f"--quantization {VLLM_QUANT[cfg.target_quant]}")
    if cfg.kv_cache != "bf16":
        cmd.append(f"--kv-cache-dtype {VLLM_KV[cfg.kv_cache]}")
    if cfg.cuda_graph_batch_sizes:
        # capture sizes count tokens: a decode step of b requests verifies b * (1 + n) tokens, and vLLM
        # rounds every size up to a multiple of 1 + n (config/compilation.py:1537-1565)
        sizes = sorted({b * (1 + n) for b in cfg.cuda_graph_batch_sizes})
        cmd.append("--cudagraph-capture-sizes " + " ".join(map(str, sizes)))
    return cmd


def sglang_command(cfg, dc: DrafterConfig, target, drafter, tokenizer) -> list[str]:
    algo = engine_of(dc.family, "sglang").layout  # DFLASH | DSPARK (speculative/spec_info.py:32-47)
    cmd = [
        f"python -m sglang.launch_server --model-path {_q(target)}",  # flags: arg_groups/fields/*.py
        f"--tokenizer-path {_q(tokenizer)}",
        f"--speculative-algorithm {algo}",
        f"--speculative-draft-model-path {_q(drafter)}",
        # DFLASH: the verify window B; DSPARK: gamma, the drafts (arg_groups/fields/spec.py:70-81)
        (
            f"--speculative-dspark-block-size {num_drafts(dc)}"
            if algo == "DSPARK"
            else f"--speculative-dflash-block-size {dc.block_size}"
        ),
        f"--tp-size {cfg.tp_size}",
        f"--max-running-requests {cfg.max_batch}",
        f"--context-length {cfg.max_seq_len}",
    ]
    if cfg.ep_size > 1:
        cmd.append(f"--ep-size {cfg.ep_size}")
    if cfg.dtype != "auto":
        cmd.append(f"--dtype {cfg.dtype}")
    if cfg.target_quant != "bf16":
        cmd.append(f"--quantization {SGLANG_QUANT[cfg.target_quant]}")
    if drafter_copy(dc.family, "sglang", cfg.drafter_quant) == "quantized":
        cmd.append(f"--speculative-draft-model-quantization {SGLANG_QUANT[cfg.drafter_quant]}")
    elif cfg.target_quant != "bf16":
        # the draft inherits --quantization unless told otherwise (arg_groups/serving_hook.py:676-708)
        cmd.append("--speculative-draft-model-quantization unquant")
    if cfg.kv_cache != "bf16":
        cmd.append(f"--kv-cache-dtype {SGLANG_KV[cfg.kv_cache]}")
    if cfg.cuda_graph_batch_sizes:  # batch sizes of the decode graphs (arg_groups/fields/exec_.py:640-643)
        cmd.append("--cuda-graph-bs-decode " + " ".join(map(str, cfg.cuda_graph_batch_sizes)))
    return cmd


COMMANDS = {"vllm": vllm_command, "sglang": sglang_command}


def drafter_note(dc: DrafterConfig, engine: str, drafter_quant: str) -> tuple[str, str]:
    """(copy, one line for the build table) for the drafter an engine is given: copy is "quantized",
    "bf16" (a quantized build whose engine loader would misread the quantized drafter) or "bf16-only";
    the line also says when the engine drops the drafter's draft vocabulary."""
    copy = drafter_copy(dc.family, engine, drafter_quant)
    sup = engine_of(dc.family, engine)
    line = {
        "quantized": f"drafter {drafter_quant} (the quantized checkpoint)",
        "bf16": f"drafter bf16 copy, not {drafter_quant}: {engine}'s {dc.family.LABEL} loader misreads "
        f"quantized drafters ({sup.source})",
        "bf16-only": "drafter bf16",
    }[copy]
    if dc.draft_vocab_size is not None and not sup.draft_vocab:
        line += f"; draft vocabulary ({dc.draft_vocab_size} tokens) dropped: {engine} drafts over the full vocabulary"
    return copy, line


def emit_commands(ctx) -> dict:
    """serve/<engine>/drafter/ (the engine's layout) and serve/<engine>.sh (the command serving the
    target with it) for each engine in cfg.emit; paths inside the scripts point into the final out dir.
    The drafter copy starts from the quantized drafter only where the engine's loader reads it (the
    family's CAPS), from the bf16 input drafter elsewhere."""
    cfg = ctx.cfg
    dc = DrafterConfig.load(ctx.dirs["drafter"])
    target, tok = ctx.model_dir("target", final=True), ctx.dirs["tokenizer"]
    written = {}
    for name in cfg.emit:
        copy, note = drafter_note(dc, name, cfg.drafter_quant)
        src = ctx.model_dir("drafter") if copy == "quantized" else ctx.dirs["drafter"]
        layout = write_serving_drafter(src, ctx.work / "serve" / name / "drafter", name, ctx.dirs["target"])
        cmd = COMMANDS[name](cfg, dc, target, ctx.final / "serve" / name / "drafter", tok)
        text = " \\\n  ".join(cmd)
        f = ctx.work / "serve" / f"{name}.sh"
        f.write_text(
            f"#!/usr/bin/env bash\n# {name} serving of this {dc.family.LABEL} pair (written by dflash-trt build);\n"
            f"# serve/{name}/drafter is the drafter in the layout {name} loads ({note})\n"
            f"set -euo pipefail\nexec {text}\n"
        )
        f.chmod(0o755)
        written[name] = {"command": text, "drafter": f"serve/{name}/drafter", "drafter_copy": copy, **layout}
        dropped = f", dropped {', '.join(layout['dropped'])}" if layout["dropped"] else ""
        added = f", added {', '.join(layout['added'])}" if layout["added"] else ""
        ctx.echo(f"emit: serve/{name}.sh + serve/{name}/drafter ({dc.family.LABEL}{dropped}{added}); {note}")
    return {"commands": written}
