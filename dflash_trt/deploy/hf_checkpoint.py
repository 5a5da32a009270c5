"""Save and load a quantised Hugging Face checkpoint folder in modelopt's export layout.

Boundary: files only (safetensors + JSON), written atomically. A folder holds
  model.safetensors      the quantised state dict (names/dtypes/shapes of quantize.py's docstring,
                          k_scale / v_scale of every attention layer with an FP8 KV cache)
  hf_quant_config.json   {"producer": {...}, "quantization": {"quant_algo", "kv_cache_quant_algo",
                          "group_size" (NVFP4), "exclude_modules"}}
  config.json            the model's config (HF or z-lab drafter layout) plus `quantization_config`
                          as modelopt writes it (quant_method "modelopt")
Tensor maths lives in quantize.py / formats.py. Folder writes here (and in convert.py) go through
atomic_dir (dflash_trt/atomic.py): the folder is built under a temporary name next to it and
renamed into place, so a reader sees either the old folder or the complete new one.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from dflash_trt.atomic import atomic_dir
from dflash_trt.deploy.files import read_state
from dflash_trt.deploy.quantize import (
    STATIC_ACT,
    attention_modules,
    hf_quantization_config,
    kv_scale_names,
    quantized_modules,
)
from dflash_trt.errors import CheckpointError, ConfigError

WEIGHTS_NAME = "model.safetensors"
QUANT_CONFIG_NAME = "hf_quant_config.json"


def _config_dict(config) -> dict:
    if config is None:
        return {}
    if isinstance(config, dict):
        return dict(config)
    if hasattr(config, "to_json_dict"):  # dflash_trt DrafterConfig
        return config.to_json_dict()
    if hasattr(config, "to_dict"):  # transformers PretrainedConfig
        return config.to_dict()
    raise ConfigError(f"config of type {type(config).__name__}: pass a dict, a transformers config or a DrafterConfig")


def unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors, none sharing storage (safetensors refuses shared memory, e.g. tied
    embeddings or two views of one tensor): a tensor on an already-used storage is cloned."""
    out, seen = {}, set()
    for k, v in state.items():
        v = v.detach().contiguous().cpu()
        key = v.untyped_storage().data_ptr()
        if key in seen and v.numel():
            v = v.clone()
        out[k] = v
        seen.add(v.untyped_storage().data_ptr())
    return out


def save_quantized_checkpoint(
    folder: str | Path,
    qstate: dict[str, torch.Tensor],
    hf_quant_config: dict,
    config=None,
    require_input_scales: bool = True,
) -> Path:
    """Write qstate + hf_quant_config.json + config.json (with quantization_config) to `folder`.
    require_input_scales: refuse FP8/NVFP4 checkpoints without activation scales, and an FP8 KV cache
    without k/v scales, since modelopt consumers (TensorRT-LLM, vLLM) need them (else they fall back
    to scale 1.0); pass False for simulation-only checkpoints."""
    algo = hf_quant_config.get("quantization", {}).get("quant_algo")
    kv_algo = hf_quant_config.get("quantization", {}).get("kv_cache_quant_algo")
    mods = quantized_modules(qstate)
    if algo is not None and not mods:
        raise ConfigError(
            f"hf_quant_config says quant_algo={algo} but the state dict has no '<module>.weight_scale' "
            f"tensors; quantise it with quantize_state_dict first"
        )
    if require_input_scales and algo in STATIC_ACT:
        missing = [m for m in mods if f"{m}.input_scale" not in qstate]
        if missing:
            raise ConfigError(
                f"{missing[0]}.input_scale missing ({len(missing)} layers): {algo} needs calibrated "
                f"activation scales; pass act_amax=calibrate_act_amax(...) to quantize_state_dict "
                f"(or require_input_scales=False for a simulation-only checkpoint)"
            )
    if require_input_scales and kv_algo == "FP8":
        missing = [n for a in attention_modules(qstate) for n in kv_scale_names(a) if n not in qstate]
        if missing:
            raise ConfigError(
                f"{missing[0]} missing ({len(missing)} tensors): kv_cache_quant_algo=FP8 needs calibrated "
                f"KV-cache scales; pass kv_amax=calibrate_amax(..., kv=True)[1] to quantize_state_dict "
                f"(or require_input_scales=False for a simulation-only checkpoint)"
            )
    cfg = _config_dict(config)
    cfg["quantization_config"] = hf_quantization_config(hf_quant_config)
    folder = Path(folder)
    with atomic_dir(folder) as tmp:
        save_file(unshared(qstate), str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / QUANT_CONFIG_NAME).write_text(json.dumps(hf_quant_config, indent=4) + "\n")
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str) + "\n")
    return folder


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def load_quantized_checkpoint(folder: str | Path) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """Read a folder written by save_quantized_checkpoint (or a modelopt HF export with one or more
    *.safetensors files). Returns (qstate, hf_quant_config, config dict)."""
    folder = Path(folder)
    qpath = folder / QUANT_CONFIG_NAME
    if not qpath.is_file():
        raise CheckpointError(f"{folder}: no {QUANT_CONFIG_NAME}; not a quantised (modelopt-layout) checkpoint")
    qstate = read_state(folder)
    hf_quant_config = _read_json(qpath)
    config = _read_json(folder / "config.json") if (folder / "config.json").is_file() else {}
    algo = hf_quant_config.get("quantization", {}).get("quant_algo")
    for m in quantized_modules(qstate):
        w = qstate.get(f"{m}.weight")
        if w is None:
            raise CheckpointError(f"{folder}: {m}.weight_scale present but {m}.weight missing")
        want = torch.uint8 if algo == "NVFP4" else torch.float8_e4m3fn
        if w.dtype != want:
            raise CheckpointError(f"{folder}: {m}.weight has dtype {w.dtype}, expected {want} for quant_algo={algo}")
    return qstate, hf_quant_config, config
