"""Target features for training: the tapped hidden states of a batch of token sequences.

Boundary: one target forward over right-padded sequences, returning the tapped layers' outputs
(no LM head); what is tapped (distill.feature_layers) and how features are stored offline
(trainer.FeatureStore) are decided by the callers. Shared by the trainer (online features, the tap
scale), validation (held-out features) and corpus scoring (the target's greedy next tokens).
"""

from __future__ import annotations

import torch


@torch.no_grad()
def target_taps(target, seqs: list[list[int]], tap_layers: list[int]) -> torch.Tensor:
    """Tapped hidden states [N, S, taps*d] of right-padded sequences (padding is causal-invisible)."""
    S = max(map(len, seqs))
    ids = torch.zeros(len(seqs), S, dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.tensor(s)
    ids = ids.to(target.device)
    no_logits = torch.zeros(len(seqs), 0, dtype=torch.long, device=target.device)  # the LM head is not needed
    return target.forward(ids, target.new_cache(len(seqs), S), tap_layers, logits_at=no_logits).taps
