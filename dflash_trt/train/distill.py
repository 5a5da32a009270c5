"""Soft labels: the target's own next-token distribution as the drafter's training label.

Boundary: training only. Given the target's last decoder layer output at every position (stored
with the tapped features when `kd_weight > 0`), build the teacher distribution for every block
position; objective.dflash_loss mixes it with the hard label. Inference is unchanged.

Why: a drafter is accepted when it predicts the target's argmax, and the target's full
distribution says how close each wrong token was. With little regenerated data (all a CPU makes),
a distribution per position carries far more signal than one token id (knowledge distillation,
as in DistillSpec / Medusa-2 self-distillation). The teacher for block position k (which must
predict x_{a+k}) is the target's distribution after reading x_{..a+k-1}: exactly what the
verification pass computes at inference when the block's earlier drafts were accepted.

With a draft vocabulary the teacher is renormalised over the draft-vocab tokens (the drafter
cannot put mass elsewhere).
"""

from __future__ import annotations

import torch


def teacher_layer(num_target_layers: int) -> int:
    """The tap holding the target's last layer state (after the final norm: target.forward taps
    layer L-1 as transformers' hidden_states[L])."""
    return num_target_layers - 1


def feature_layers(tap_layers: list[int], num_target_layers: int, kd: bool) -> list[int]:
    """Layers stored per token: the drafter's taps, then (with soft labels) the teacher layer."""
    return list(tap_layers) + ([teacher_layer(num_target_layers)] if kd else [])


def split_features(feats: torch.Tensor, num_taps: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """feats [N, S, W] -> (drafter taps [N, S, num_taps*d], teacher states [N, S, d] or None)."""
    w = num_taps * hidden
    if feats.shape[-1] == w:
        return feats, None
    if feats.shape[-1] != w + hidden:
        raise ValueError(f"features of width {feats.shape[-1]}: expected {w} (taps) or {w + hidden} (taps + teacher)")
    return feats[..., :w], feats[..., w:]


@torch.no_grad()
def soft_labels(drafter, teacher: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Teacher distribution of every block position 1..B-1, over the drafter's head vocabulary.

    teacher [N, S, d]: the target's last layer state, final norm applied; positions [N, J, B]: the blocks' absolute
    positions (a..a+B-1) -> probabilities [N, J, B-1, Vd] (float32), Vd = draft vocab size or V.
    Position k's distribution is read at sequence position a+k-1. The logits are the target's
    (LM head on the normed state), through drafter.head_logits: the same draft-vocab rows the drafter uses."""
    N, J, B = positions.shape
    target = drafter.target
    at = positions[..., :-1].reshape(N, -1)  # [N, J*(B-1)]
    h = teacher.gather(1, at[..., None].expand(-1, -1, teacher.shape[-1]))  # [N, J*(B-1), d]
    logits = drafter.head_logits(h.to(target.lm_head.weight.dtype))  # the tap is already normed
    return logits.softmax(-1).view(N, J, B - 1, -1)
