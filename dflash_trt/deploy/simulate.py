"""Load a quantised (Model Optimizer HF layout) target or drafter folder for CPU simulation.

Boundary: dequantise-on-load only. The FP8 / NVFP4 weights of a folder written by the `quantize`
build stage (hf_quant_config.json + model.safetensors) are turned back into float tensors
(quantize.dequantize_state_dict) and loaded into the ordinary PyTorch modules, so the engine runs
with exactly the rounding the quantised checkpoint carries: weight error is simulated, fp8/fp4
GEMM arithmetic and activation quantisation are not (they need Hopper/Blackwell tensor cores). On a GPU
with FP8 tensor cores an FP8 target runs natively instead (use_native_fp8, modeling/lowp_linear.py).
api.load_target / load_drafter call these when a folder has hf_quant_config.json.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dflash_trt.config import DrafterConfig
from dflash_trt.deploy.hf_checkpoint import QUANT_CONFIG_NAME, load_quantized_checkpoint
from dflash_trt.deploy.quantize import dequantize_state_dict
from dflash_trt.errors import CheckpointError
from dflash_trt.modeling.drafter import DFlashDrafter
from dflash_trt.modeling.lowp_linear import native_fp8_reason, swap_in_fp8
from dflash_trt.modeling.target import SUPPORTED_MODEL_TYPES, TargetModel


def is_quantized_dir(folder: str | Path | None) -> bool:
    return folder is not None and (Path(folder) / QUANT_CONFIG_NAME).is_file()


def _dequantized(folder: Path, dtype: torch.dtype) -> tuple[dict, dict]:
    qstate, hf_qc, cfg = load_quantized_checkpoint(folder)
    cfg = {k: v for k, v in cfg.items() if k != "quantization_config"}
    return dequantize_state_dict(qstate, hf_qc, dtype), cfg


def load_quantized_target(folder: str | Path, dtype: torch.dtype = torch.float32):
    """TargetModel whose Linear weights are the dequantised FP8/NVFP4 weights of `folder`."""
    # deferred: transformers takes ~0.6 s to import, and `dflash-trt --help` imports this module
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder)
    state, cfg = _dequantized(folder, dtype)
    model_type = cfg.pop("model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"{folder}/config.json: model_type={model_type!r}; supported: " f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    config = AutoConfig.for_model(model_type, **cfg)
    hf = AutoModelForCausalLM.from_config(config, dtype=dtype)
    ours = hf.state_dict()
    # tied embeddings: lm_head.weight is the embedding and is not stored in the checkpoint
    missing = [k for k in ours if k not in state and not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing:
        raise CheckpointError(f"{folder}: missing tensors {missing[:4]} (written by another tool?)")
    for k, t in state.items():
        if k in ours and tuple(t.shape) != tuple(ours[k].shape):
            raise CheckpointError(
                f"{folder}: tensor {k} has shape {tuple(t.shape)}, config implies " f"{tuple(ours[k].shape)}"
            )
    hf.load_state_dict(
        {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items() if k in ours}, strict=False
    )
    if config.tie_word_embeddings:
        hf.tie_weights()
    return TargetModel(hf.eval(), folder)  # its tokenizer files add stop ids


def use_native_fp8(target, folder: str | Path) -> list[str]:
    """On a GPU with FP8 tensor cores (sm_89+), swap the target's dequantized linears for FP8 ones that keep
    the checkpoint's FP8 weights (modeling/lowp_linear.py); elsewhere nothing changes. Returns the swapped
    module names."""
    if native_fp8_reason(target.device) is not None:
        return []
    qstate, hf_qc, _ = load_quantized_checkpoint(folder)
    if hf_qc.get("quantization", {}).get("quant_algo") != "FP8":
        return []
    swapped = swap_in_fp8(target.hf, qstate)
    if swapped:
        torch.cuda.empty_cache()  # the dequantized weights the swap replaced
    return swapped


def load_quantized_drafter(folder: str | Path, target=None, dtype: torch.dtype | None = None):
    """DFlashDrafter whose Linear weights are the dequantised FP8/NVFP4 weights of `folder`."""
    folder = Path(folder)
    state, cfg = _dequantized(folder, torch.float32)
    return DFlashDrafter.from_state_dict(DrafterConfig.from_json_dict(cfg), state, str(folder), target, dtype)
