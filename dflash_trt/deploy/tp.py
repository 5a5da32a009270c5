"""One linear layer, plain or quantised, and its tensor-parallel split / fuse / merge.

Boundary: pure tensors for a single linear (weight plus its bias and scales); the model-level
naming and layer walk live in convert.py. Scales travel with their weights:
  per-tensor scales ([] FP8 weight_scale, NVFP4 weight_scale_2, input_scale) are replicated;
  per-channel scales ([out], FP8_PER_CHANNEL_PER_TOKEN) follow the output rows;
  NVFP4 block scales ([out, in/16]) follow rows (column-parallel) or 16-blocks (row-parallel).
TensorRT-LLM names written by to_trt (as in its modelopt-exported checkpoints, see
tensorrt_llm/models/modeling_utils.py preprocess_perlayer_weights):
  plain  weight, bias
  FP8    weight (fp8), weights_scaling_factor [1], activation_scaling_factor [1]
  FP8_PER_CHANNEL_PER_TOKEN  weight (fp8), per_channel_scale [out]
  NVFP4  weight (uint8 [out, in/2]), weights_scaling_factor (fp8 [out, in/16]),
         weights_scaling_factor_2 [1], activation_scaling_factor [1]
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from dflash_trt.deploy import formats as F
from dflash_trt.errors import ConfigError


@dataclass
class QLinear:
    weight: torch.Tensor  # [out, in] float | float8_e4m3fn [out, in] | uint8 packed NVFP4 [out, in/2]
    bias: torch.Tensor | None = None  # [out]
    weight_scale: torch.Tensor | None = None  # FP8 [] | FP8 per-channel [out] | NVFP4 fp8 [out, in/16]
    weight_scale_2: torch.Tensor | None = None  # NVFP4 global scale []
    input_scale: torch.Tensor | None = None  # static activation scale []

    @property
    def algo(self) -> str | None:
        if self.weight.dtype == torch.uint8:
            return "NVFP4"
        if self.weight.dtype == F.FP8_DTYPE:
            return "FP8_PER_CHANNEL_PER_TOKEN" if self.weight_scale.dim() == 1 else "FP8"
        return None

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def replace(self, **kw) -> QLinear:
        return dataclasses.replace(self, **kw)


def from_hf(state: dict, module: str) -> QLinear:
    """QLinear from a (possibly modelopt-quantised) HF state dict; `module` e.g. 'model.layers.0.mlp.up_proj'."""
    if f"{module}.weight" not in state:
        raise ConfigError(f"state dict has no {module}.weight: is this the right model family?")
    g = state.get
    return QLinear(
        g(f"{module}.weight"),
        g(f"{module}.bias"),
        g(f"{module}.weight_scale"),
        g(f"{module}.weight_scale_2"),
        g(f"{module}.input_scale"),
    )


def _one(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().reshape(1)


def to_trt(lin: QLinear, prefix: str, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """TensorRT-LLM checkpoint tensors of one linear; `prefix` ends with '.'; plain weights and
    biases are cast to `dtype` (None: kept)."""
    algo = lin.algo
    cast = (lambda t: t) if dtype is None else (lambda t: t.to(dtype))  # noqa: E731
    out = {prefix + "weight": lin.weight if algo else cast(lin.weight)}
    if lin.bias is not None:
        out[prefix + "bias"] = cast(lin.bias)
    if algo == "FP8_PER_CHANNEL_PER_TOKEN":
        out[prefix + "per_channel_scale"] = lin.weight_scale.float()
    elif algo in ("FP8", "NVFP4"):
        out[prefix + "weights_scaling_factor"] = lin.weight_scale if algo == "NVFP4" else _one(lin.weight_scale)
        if algo == "NVFP4":
            out[prefix + "weights_scaling_factor_2"] = _one(lin.weight_scale_2)
        if lin.input_scale is None:
            raise ConfigError(
                f"{prefix}activation_scaling_factor: {algo} needs a calibrated input_scale; quantise "
                f"with act_amax=calibrate_act_amax(...)"
            )
        out[prefix + "activation_scaling_factor"] = _one(lin.input_scale)
    return out


def from_trt(state: dict, prefix: str) -> QLinear:
    """Inverse of to_trt (scalar [1] scales come back as [])."""
    g = state.get
    ws = g(prefix + "weights_scaling_factor", g(prefix + "per_channel_scale"))
    if ws is not None and ws.dtype != F.FP8_DTYPE and g(prefix + "per_channel_scale") is None:
        ws = ws.reshape(())
    ws2, ins = g(prefix + "weights_scaling_factor_2"), g(prefix + "activation_scaling_factor")
    return QLinear(
        state[prefix + "weight"],
        g(prefix + "bias"),
        ws,
        None if ws2 is None else ws2.reshape(()),
        None if ins is None else ins.reshape(()),
    )


def _rows(t: torch.Tensor | None, tp: int, rank: int) -> torch.Tensor | None:
    return None if t is None or t.dim() == 0 else t.chunk(tp, dim=0)[rank].contiguous()


def split_column(lin: QLinear, tp: int, rank: int) -> QLinear:
    """Column-parallel shard: output rows rank*out/tp ... (scales [] replicate)."""
    if lin.out_features % tp:
        raise ConfigError(f"output dim {lin.out_features} is not divisible by tp_size={tp}")
    ws = lin.weight_scale
    if ws is not None and ws.dim() > 0:
        ws = _rows(ws, tp, rank)
    return lin.replace(weight=_rows(lin.weight, tp, rank), bias=_rows(lin.bias, tp, rank), weight_scale=ws)


def split_row(lin: QLinear, tp: int, rank: int) -> QLinear:
    """Row-parallel shard: input columns (bias and per-channel scales replicate)."""
    cols = lin.weight.shape[1] * (2 if lin.algo == "NVFP4" else 1)
    unit = F.NVFP4_BLOCK * tp if lin.algo == "NVFP4" else tp
    if cols % unit:
        raise ConfigError(
            f"input dim {cols} is not divisible by {unit} (tp_size={tp}"
            f"{' x NVFP4 block 16' if lin.algo == 'NVFP4' else ''}); use a smaller tp_size"
        )
    w = lin.weight.chunk(tp, dim=1)[rank].contiguous()
    ws = lin.weight_scale.chunk(tp, dim=1)[rank].contiguous() if lin.algo == "NVFP4" else lin.weight_scale
    return lin.replace(weight=w, weight_scale=ws)


def _max(ts):
    ts = [t for t in ts if t is not None]
    return None if not ts else torch.stack([t.float().reshape(()) for t in ts]).max()


def unify_scales(lins: list[QLinear]) -> list[QLinear]:
    """Make per-tensor weight scales and input scales equal across layers to be fused (TensorRT-LLM
    keeps one scale per fused linear); layers whose scale changes are re-quantised, as TensorRT-LLM's
    FP8Linear does. Layers quantised by quantize_state_dict already share them (no change)."""
    algo = lins[0].algo
    if any(x.algo != algo for x in lins):
        raise ConfigError(f"layers to fuse mix quantisation formats {[x.algo for x in lins]}; quantise them alike")
    ins = _max(x.input_scale for x in lins)
    out = []
    if algo == "FP8":
        s = _max(x.weight_scale for x in lins)
        for x in lins:
            w = (
                x.weight
                if torch.equal(x.weight_scale.float().reshape(()), s)
                else F.fp8_quantize(F.fp8_dequantize(x.weight, x.weight_scale), s)
            )
            out.append(x.replace(weight=w, weight_scale=s, input_scale=ins))
    elif algo == "NVFP4":
        g = _max(x.weight_scale_2 for x in lins)
        for x in lins:
            if not torch.equal(x.weight_scale_2.float().reshape(()), g):
                w, bs, _ = F.nvfp4_quantize(F.nvfp4_dequantize(x.weight, x.weight_scale, x.weight_scale_2), g)
                x = x.replace(weight=w, weight_scale=bs)
            out.append(x.replace(weight_scale_2=g, input_scale=ins))
    else:
        out = [x.replace(input_scale=ins) if ins is not None else x for x in lins]
    return out


def cat_rows(lins: list[QLinear]) -> QLinear:
    """Stack layers along the output dim (fused q|k|v, or the column shards of one layer)."""
    lins = unify_scales(lins)
    first = lins[0]
    cat = lambda ts: None if ts[0] is None else torch.cat(ts, dim=0)  # noqa: E731
    ws = first.weight_scale
    if ws is not None and ws.dim() > 0:
        ws = cat([x.weight_scale for x in lins])
    return first.replace(weight=cat([x.weight for x in lins]), bias=cat([x.bias for x in lins]), weight_scale=ws)


def cat_cols(lins: list[QLinear]) -> QLinear:
    """Inverse of split_row over all ranks."""
    first = lins[0]
    ws = torch.cat([x.weight_scale for x in lins], dim=1) if first.algo == "NVFP4" else first.weight_scale
    return first.replace(weight=torch.cat([x.weight for x in lins], dim=1), weight_scale=ws)


def split_heads(lin: QLinear, sizes: list[int]) -> list[QLinear]:
    """Split a fused linear's output rows into consecutive parts of `sizes` rows (e.g. q, k, v)."""

    def part(t):
        return [None] * len(sizes) if t is None or t.dim() == 0 else list(t.split(sizes, dim=0))

    per_row = lin.weight_scale is not None and lin.weight_scale.dim() > 0
    ws = part(lin.weight_scale) if per_row else [lin.weight_scale] * len(sizes)
    return [lin.replace(weight=w, bias=b, weight_scale=s) for w, b, s in zip(part(lin.weight), part(lin.bias), ws)]


def dup_kv_heads(lin: QLinear, num_kv_heads: int, tp: int) -> QLinear:
    """Repeat each of `num_kv_heads` heads tp/num_kv_heads times (num_kv_heads < tp), so that each
    rank holds a whole K/V head, as TensorRT-LLM's converters do."""
    reps = tp // num_kv_heads

    def dup(t):
        if t is None or t.dim() == 0:
            return t
        h = t.reshape(num_kv_heads, -1, *t.shape[1:])
        return h.repeat_interleave(reps, dim=0).reshape(-1, *t.shape[1:]).contiguous()

    return lin.replace(weight=dup(lin.weight), bias=dup(lin.bias), weight_scale=dup(lin.weight_scale))
