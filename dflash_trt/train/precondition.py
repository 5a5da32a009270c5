"""Tap scaling: train the drafter's fc on target features divided by their per-dimension RMS.

Boundary: training only. The saved drafter is unchanged in form (z-lab layout, fc applied to raw
tapped states); the scaling lives in the fc module used while training and is folded into the
weight whenever a state_dict is taken.

Why: the tapped layers of a real target differ 10-100x in scale (Qwen2.5-0.5B: RMS 0.28 at layer 1,
2.5 at layer 21, one dimension of layer 21 near 56; the first token's state near 75). Adam moves
every fc weight by about lr per step, so a weight reading a small-scale input changes the fused
feature 10-100x more slowly than one reading a large-scale input: the early layers, which carry
token identity, are barely learned in a short run. Dividing each input dimension by its RMS gives
all of them the same effective learning rate. On the 0.5B recipe this lowered the loss and raised
held-out acceptance at equal steps (docs/training.md#qwen25-coder-recipe).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FLOOR = 0.05  # scales below FLOOR * median are raised to it: near-constant dims are not amplified


def tap_scale(samples: list[torch.Tensor]) -> torch.Tensor:
    """Per-dimension RMS of tapped features, samples: one [n_i, W] tensor per sequence -> [W] (float32).

    Position 0 of every sequence is left out: a target's first token carries massive activations
    (attention sink) that would set the scale of those dimensions for every other token."""
    rows = [s[1:].float() for s in samples if s.shape[0] > 1]
    if not rows:
        raise ValueError("tap_scale needs at least one sequence of two or more tokens")
    x = torch.cat(rows)
    rms = x.pow(2).mean(0).sqrt()
    return rms.clamp_min(max(float(rms.median()) * FLOOR, 1e-6))


class ScaledFC(nn.Linear):
    """fc(x) = W' (x / scale): W' is the trained parameter; state_dict() holds W = W' / scale, the
    weight of a plain fc on raw taps, and load_state_dict() takes W back (W' = W * scale)."""

    def __init__(self, fc: nn.Linear, scale: torch.Tensor):
        super().__init__(fc.in_features, fc.out_features, bias=False, device=fc.weight.device, dtype=fc.weight.dtype)
        if fc.bias is not None or scale.shape != (fc.in_features,):
            raise ValueError(f"ScaledFC wraps a bias-free fc with one scale per input ({fc.in_features})")
        with torch.no_grad():
            self.weight.copy_(fc.weight)  # the default init, now in the normalised input space
        self.register_buffer("scale", scale.to(device=fc.weight.device, dtype=torch.float32), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x / self.scale.to(x.dtype), self.weight)

    def raw_weight(self) -> torch.Tensor:
        return self.weight / self.scale.to(self.weight.dtype)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        w = self.raw_weight()
        destination[prefix + "weight"] = w if keep_vars else w.detach()

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        key = prefix + "weight"
        if key in state_dict:
            state_dict[key] = state_dict[key].to(self.scale.device) * self.scale.to(state_dict[key].dtype)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )


def use_tap_scaling(drafter, scale: torch.Tensor) -> ScaledFC:
    """Swap the drafter's fc for a ScaledFC with the same initial weight; call before making the optimizer."""
    fc = ScaledFC(drafter.fc, scale)
    drafter.fc = fc
    return fc
