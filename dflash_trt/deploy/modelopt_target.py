"""The target's quantized checkpoint, produced by NVIDIA Model Optimizer (nvidia-modelopt 0.47, `quant` extra).

Boundary: one Hugging Face target folder in, one quantized folder out, written by modelopt's own
`export_hf_checkpoint` (safetensors shards + hf_quant_config.json + config.json with quantization_config):
FP8 (FP8_DEFAULT_CFG), NVFP4 (NVFP4_DEFAULT_CFG), NVFP4 with AWQ-lite (NVFP4_AWQ_LITE_CFG, awq: true) and an
FP8 KV cache (FP8_KV_CFG: k/v_bmm_quantizer amax -> k_scale / v_scale). Which layers modelopt quantizes and
what it excludes (lm_head, embeddings, routers) is its default config's decision, not ours. The drafter is
not a transformers model, which export_hf_checkpoint needs: deploy/quantize.py still writes it.

Scale (why the target is never whole in memory): the model is built by transformers with an accelerate
device map that sends every decoder layer to "disk" -- for a safetensors checkpoint that is the checkpoint
itself (accelerate's offload index points into the shards; nothing is copied) -- so each layer's weights are
read in their checkpoint dtype when its forward runs and dropped after. The embeddings and LM head stay
resident (checkpoint dtype): modelopt's export runs a dummy forward to find fused layers
(requantize_resmooth_fused_llm_layers) that fails on a disk-offloaded embedding ("Cannot copy out of meta
tensor"), and the embedding is needed by every calibration forward anyway. Calibration is modelopt's
layerwise mode (algorithm.layerwise.enable): it captures the inputs of one decoder layer for all calibration
prompts, calibrates that layer, and moves on, so one layer's weights
plus the calibration activations [prompts, tokens, hidden] are live at a time. export_hf_checkpoint sees the
offload hooks and takes its streaming path (unified_export_hf_streaming.py), which materializes, exports and
writes one layer at a time into shards of SHARD_SIZE. Why this route rather than our own sequential
onloading: it is the one modelopt implements end to end (calibration, AWQ, export) for offloaded models;
accelerate's device map is also what puts the forwards on a GPU when there is one (execution device cuda:0,
weights still streamed from disk), so the same code serves a CPU builder and a GPU host.
Peak host memory ~ embeddings + LM head + the largest decoder layer (checkpoint dtype) + one shard buffer +
calibration activations; measured in docs/deploy.md ("Quantizing large targets").
"""

from __future__ import annotations

import copy
import json
import shutil
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open

from dflash_trt.errors import ConfigError

SHARD_SIZE = 2**30  # export shard buffer (bytes): bounds the export's memory next to one layer
FORMATS = ("fp8", "nvfp4")
# calibration forwards per device: the prompts of one forward ([1, T] each: no padding, no attention mask)


def _mtq():
    """modelopt's quantization package (deferred: it takes seconds to import and is the `quant` extra's)."""
    try:
        import modelopt.torch.quantization as mtq
    except ImportError:
        raise ConfigError(
            "target_quant: quantizing needs NVIDIA Model Optimizer; pip install 'dflash-trt[quant]' "
            "(nvidia-modelopt==0.47.0)"
        ) from None
    return mtq


def quant_config(fmt: str, kv_cache: str | None, awq: bool = False) -> dict:
    """modelopt's config for the format, plus its FP8 KV-cache quantizers, calibrated layer by layer.
    AWQ mutates weights while calibrating, so its layerwise run keeps calib_mutates_weights (the default)."""
    mtq = _mtq()
    if fmt not in FORMATS:
        raise ConfigError(f"target_quant={fmt}: Model Optimizer formats here are {', '.join(FORMATS)}")
    if awq and fmt != "nvfp4":
        raise ConfigError(f"awq=true with target_quant={fmt}: AWQ applies to nvfp4 only; set awq: false")
    base = mtq.NVFP4_AWQ_LITE_CFG if awq else (mtq.NVFP4_DEFAULT_CFG if fmt == "nvfp4" else mtq.FP8_DEFAULT_CFG)
    cfg = copy.deepcopy(base)
    if kv_cache == "fp8":
        cfg["quant_cfg"] = list(cfg["quant_cfg"]) + copy.deepcopy(list(mtq.FP8_KV_CFG["quant_cfg"]))
    algo = cfg.get("algorithm") or "max"
    algo = {"method": algo} if isinstance(algo, str) else dict(algo)
    # max calibration only sets quantizer amax: calib_mutates_weights false keeps modelopt from writing each
    # layer's weights back into host memory (its disk-offload writeback keeps them in a CPU state dict)
    algo["layerwise"] = {"enable": True, "calib_mutates_weights": awq}
    cfg["algorithm"] = algo
    return cfg


def offload_map(config) -> dict[str, str]:
    """accelerate device map: every weight-holding module of a decoder-only HF model on "disk" (read from the
    checkpoint's own shards when it runs), the rotary embedding and final norm on the execution device."""
    dev = "cuda:0" if torch.cuda.is_available() else "cpu"
    dm = {"model.rotary_emb": dev, "model.norm": dev, "model.embed_tokens": dev, "lm_head": dev}
    dm.update({f"model.layers.{i}": "disk" for i in range(config.num_hidden_layers)})
    return dm


def load_offloaded(src: Path, offload_dir: Path):
    """The target as transformers builds it, every large module offloaded (offload_map), weights in the
    checkpoint's dtype."""
    from transformers import AutoConfig, AutoModelForCausalLM  # deferred: transformers takes ~0.6 s to import

    config = AutoConfig.from_pretrained(src)
    return AutoModelForCausalLM.from_pretrained(
        src, dtype="auto", device_map=offload_map(config), offload_folder=str(offload_dir)
    )


@contextmanager
def _no_offload_writeback():
    """modelopt 0.47's streaming export materializes each offloaded layer, exports it in place, streams it to
    a shard and then 'writes back' the exported tensors -- for a disk-offloaded layer into accelerate's CPU
    state dict (plugins/accelerate.py _writeback_params_to_weights_map: "writing updates back to disk offload
    files is TODO"), which would keep every exported layer in host memory. A layer is not read again once
    streamed, so the writeback is skipped while exporting (with it skipped, accelerate's CPU state dict is
    empty after the export); tests/test_build_memory.py holds the memory bound."""
    from modelopt.torch.quantization.plugins import accelerate as plugin  # deferred with _mtq

    original = plugin._writeback_params_to_weights_map
    plugin._writeback_params_to_weights_map = lambda module, hook: None
    try:
        yield
    finally:
        plugin._writeback_params_to_weights_map = original


def quantize_target(
    src: Path,
    dst: Path,
    fmt: str,
    kv_cache: str | None,
    calib: list[list[int]],
    awq: bool = False,
    echo: Callable[[str], None] = print,
    shard_size: int = SHARD_SIZE,
) -> dict:
    """Quantize the HF target in `src` into `dst` with modelopt (layerwise calibration on `calib`, token-id
    lists, one forward each), export it with export_hf_checkpoint; returns what the build log records."""
    from modelopt.torch.export import export_hf_checkpoint  # deferred with _mtq (the `quant` extra)

    mtq = _mtq()
    cfg = quant_config(fmt, kv_cache, awq)
    if not calib:
        raise ConfigError("calib_prompts=0: Model Optimizer needs calibration prompts; set calib_prompts >= 1")
    offload = dst.parent / f".{dst.name}.offload"
    shutil.rmtree(offload, ignore_errors=True)
    times = {}
    try:
        t = time.perf_counter()
        model = load_offloaded(src, offload)
        model.eval()
        times["load_s"] = time.perf_counter() - t
        device = next((b.device for b in model.buffers() if b.device.type != "meta"), torch.device("cpu"))

        @torch.no_grad()
        def forward_loop(m):
            for ids in calib:
                m(torch.tensor([ids], device=device))  # [1, T]

        t = time.perf_counter()
        model = mtq.quantize(model, cfg, forward_loop=forward_loop)
        times["calibrate_s"] = time.perf_counter() - t
        t = time.perf_counter()
        dst.mkdir(parents=True, exist_ok=True)
        with _no_offload_writeback():
            export_hf_checkpoint(model, export_dir=str(dst), max_shard_size=shard_size)
        times["export_s"] = time.perf_counter() - t
    finally:
        shutil.rmtree(offload, ignore_errors=True)
    hf_qc = json.loads((dst / "hf_quant_config.json").read_text())
    names = [k for f in sorted(dst.glob("*.safetensors")) for k in safe_open(str(f), framework="pt").keys()]
    q = hf_qc["quantization"]
    echo(
        f"quantize: target -> {q['quant_algo']} by Model Optimizer {hf_qc['producer']['version']} "
        f"(layerwise over {len(calib)} prompts; KV cache {q.get('kv_cache_quant_algo') or 'not quantized'}; "
        f"excluded: {', '.join(q.get('exclude_modules') or []) or 'none'})"
    )
    return {
        "format": q["quant_algo"],
        "kv_cache_quant_algo": q.get("kv_cache_quant_algo"),
        "producer": hf_qc["producer"],
        "exclude_modules": q.get("exclude_modules") or [],
        "calibration_prompts": len(calib),
        "quantized_linears": sum(1 for k in names if k.endswith(".weight_scale")),
        "kv_scales": sum(1 for k in names if k.endswith((".k_scale", ".v_scale"))),
        "output_bytes": sum(f.stat().st_size for f in dst.glob("*.safetensors")),
        **{k: round(v, 2) for k, v in times.items()},
    }
