"""DFlash training objective: many blocks per sequence in one drafter forward under one mask.

Boundary: given target features and tokens, build the blocks (anchors), run the drafter's layers
on all of them at once, and return the position-weighted loss and accuracy statistics. The
optimiser loop is in trainer.py.

A block anchored at position a is [x_a, MASK * (B-1)] at positions a..a+B-1 and must predict
x_{a+1}..x_{a+B-1}, exactly as at inference where the block opens with the last verified token.
Its queries see the context features of positions < a (their K/V injected by each layer's own
k_proj/v_proj, as in inject_context) and the B entries of their own block, never another
block. The mask is [J*B, S + J*B] per sequence: O(J*B*S), never O(S^2) per block.

dflash_loss is plain DFlash's loss; family_loss is every family's (plain DFlash's included): the same
forward, then the family module's train_terms (dflash_trt/families) reduced with the same weights.
The update rule (make_optimizer, optimizer_step, cosine_lr) is here too, next to the loss it steps:
tests/test_train_parity_*.py hold both against SpecForge 0.2.0's training code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash_trt.errors import ConfigError
from dflash_trt.modeling.drafter import DFlashDrafter

DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    """Loss decay of the DFlash recipe (7 for B=16, 5 for B=10, 4 for B=8; ~B/2.3 otherwise)."""
    return DEFAULT_GAMMA.get(block_size, max(1.0, block_size / 2.3))


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for block positions k = 1..B-1 -> [B-1]."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def anchor_range(length: int, prompt_len: int, block_size: int) -> tuple[int, int]:
    """Inclusive range (lo, hi) of admissible anchors: response positions a with a + B <= length
    (position 0 never: its block would have no context). Empty when hi < lo."""
    return max(prompt_len, 1), length - block_size


def trainable(seq: dict, block_size: int) -> bool:
    """Whether a data sequence ({"input_ids", "prompt_len"}) has room for at least one block."""
    lo, hi = anchor_range(len(seq["input_ids"]), seq["prompt_len"], block_size)
    return hi >= lo


def sample_anchors(
    lengths: list[int], prompt_lens: list[int], num: int, block_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `num` distinct anchors per sequence among response positions a with a + B <= length.

    -> anchors [N, num] (long), valid [N, num] (bool)."""
    N = len(lengths)
    anchors = torch.zeros(N, num, dtype=torch.long)
    valid = torch.zeros(N, num, dtype=torch.bool)
    for r, (L, P) in enumerate(zip(lengths, prompt_lens)):
        lo, hi = anchor_range(L, P, block_size)
        if hi < lo:
            continue
        cand = torch.arange(lo, hi + 1)
        pick = cand[torch.randperm(len(cand), generator=generator)[:num]].sort().values
        anchors[r, : len(pick)] = pick
        valid[r, : len(pick)] = True
    return anchors, valid


@dataclass
class BlockBatch:
    block_ids: torch.Tensor  # [N, J, B] anchor token then mask tokens
    labels: torch.Tensor  # [N, J, B-1] tokens the block positions 1..B-1 must predict
    positions: torch.Tensor  # [N, J, B] absolute positions
    anchors: torch.Tensor  # [N, J]
    valid: torch.Tensor  # [N, J]
    label_mask: torch.Tensor | None = None  # [N, J, B-1] bool: which labels count (None: all)


def next_tokens(batch: list[dict], S: int, device) -> torch.Tensor | None:
    """target_next [N, S] for make_blocks when any sequence of the batch is teacher-forced text
    (corpus.py); a regenerated sequence's next tokens are its own (every label then counts). None
    when the whole batch is regenerated answers."""
    if not any("target_next" in s for s in batch):
        return None
    nxt = torch.zeros(len(batch), S, dtype=torch.long)
    for r, s in enumerate(batch):
        row = s.get("target_next") or s["input_ids"][1:] + [0]
        nxt[r, : len(row)] = torch.tensor(row)
    return nxt.to(device)


def make_blocks(
    input_ids: torch.Tensor,
    anchors: torch.Tensor,
    valid: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    target_next: torch.Tensor | None = None,
) -> BlockBatch:
    """input_ids [N, S] (padded), anchors/valid [N, J] -> the blocks and their labels.

    Without target_next the labels are the sequence's own next tokens (the target's regenerated
    answers). With target_next [N, S] (the target's greedy token after each position, for text the
    target did not write, see corpus.py) the label of block position k is target_next[a+k-1], and
    it counts only while the text agrees with greedy decoding: label_mask[k] = all of
    x_{a+j} == target_next[a+j-1] for j = 1..k-1 (position 1 always counts)."""
    B = block_size
    pos = anchors[..., None] + torch.arange(B, device=anchors.device)  # [N, J, B]
    pos = torch.where(valid[..., None], pos, torch.zeros_like(pos))
    toks = input_ids.gather(1, pos.flatten(1)).view_as(pos)
    block = torch.full_like(toks, mask_token_id)
    block[..., 0] = toks[..., 0]
    if target_next is None:
        return BlockBatch(block, toks[..., 1:], pos, anchors, valid)
    nxt = target_next.gather(1, pos.flatten(1)).view_as(pos)[..., :-1]  # [N, J, B-1]: label of position k
    agree = toks[..., 1:-1] == nxt[..., :-1]  # [N, J, B-2]: x_{a+j} is the greedy token, j = 1..B-2
    ones = torch.ones_like(agree[..., :1])
    label_mask = torch.cat([ones, agree], -1).long().cumprod(-1).bool()
    return BlockBatch(block, nxt, pos, anchors, valid, label_mask)


def block_mask(anchors: torch.Tensor, valid: torch.Tensor, S: int, B: int) -> torch.Tensor:
    """Visibility [N, J*B, S + J*B]: context position < own anchor, or same block."""
    N, J = anchors.shape
    dev = anchors.device
    ctx = torch.arange(S, device=dev)[None, None, :] < anchors.repeat_interleave(B, 1)[..., None]  # [N, JB, S]
    blk = torch.arange(J, device=dev).repeat_interleave(B)
    same = (blk[:, None] == blk[None, :])[None].expand(N, -1, -1)  # [N, JB, JB]
    # invalid (padding) blocks still see themselves so that no softmax row is empty
    return torch.cat([ctx & valid.repeat_interleave(B, 1)[..., None], same], dim=-1)


def drafter_train_forward(drafter: DFlashDrafter, taps: torch.Tensor, blocks: BlockBatch) -> torch.Tensor:
    """All blocks of every sequence in one pass. taps [N, S, n_taps*d] -> hidden [N, J, B, d] (after norm).

    A family's convolutions around attention and MLP (DFlash 2: layer.attention_conv / mlp_conv) run
    as draft_block runs them, over each block's own B positions: [N, J*B, d] is viewed as [N*J, B, d]
    so that no convolution reads across a block boundary."""
    N, J, B = blocks.block_ids.shape
    S = taps.shape[1]
    target = drafter.target
    ctx = drafter.fuse(taps)  # [N, S, d]
    ctx_pos = torch.arange(S, device=taps.device)[None].expand(N, S)
    ccos, csin = drafter.rotary(ctx_pos, ctx.dtype)
    pos = blocks.positions.flatten(1)  # [N, JB]
    x = target.embed(blocks.block_ids.flatten(1))
    if drafter.config.input_embedding_scale != 1.0:  # as draft_block scales it
        x = x * drafter.config.input_embedding_scale
    x = x.to(ctx.dtype)
    bcos, bsin = drafter.rotary(pos, x.dtype)
    plain = block_mask(blocks.anchors, blocks.valid, S, B).to(taps.device)  # [N, JB, S+JB]
    key_pos = torch.cat([ctx_pos, pos], 1)[:, None, :]  # [N, 1, S+JB]: a key's absolute position
    for i, layer in enumerate(drafter.layers):
        visible = _layer_mask(plain, pos[:, :, None], key_pos, *drafter.config.layer_attention(i))[:, None]
        attn = layer.self_attn
        ac, mc = layer.attention_conv, layer.mlp_conv  # None but for a family that adds them
        k_ctx, v_ctx = attn.kv(ctx, ccos, csin)
        h = layer.input_layernorm(x)
        if ac is not None:
            h, finish = _per_block(ac.prepare, h, B)
        k_blk, v_blk = attn.kv(h, bcos, bsin)
        q = attn.q(h, bcos, bsin)
        k, v = torch.cat([k_ctx, k_blk], 2), torch.cat([v_ctx, v_blk], 2)
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=visible, scale=attn.scale, enable_gqa=attn.num_heads != attn.num_kv_heads
        )
        h = attn.o_proj(o.transpose(1, 2).reshape(N, J * B, -1))
        x = x + (h if ac is None else _per_block(ac.finish, h, B, finish))
        h = layer.post_attention_layernorm(x)
        if mc is not None:
            h, finish = _per_block(mc.prepare, h, B)
        h = layer.ffn(h)
        x = x + (h if mc is None else _per_block(mc.finish, h, B, finish))
    return drafter.norm(x).view(N, J, B, -1)


def _per_block(fn, x: torch.Tensor, B: int, *extra):
    """fn over x [N, J*B, d] seen as [N*J, B, d] (one row per block); results back in [N, J*B, ...]."""
    N = x.shape[0]
    out = fn(x.reshape(-1, B, x.shape[-1]), *extra)
    if isinstance(out, tuple):
        return tuple(t.reshape(N, -1, *t.shape[2:]) for t in out[:1]) + out[1:]
    return out.reshape(N, -1, out.shape[-1])


def _layer_mask(
    plain: torch.Tensor, q_pos: torch.Tensor, key_pos: torch.Tensor, causal: bool, window: int | None
) -> torch.Tensor:
    """plain [N, JB, S+JB] narrowed for a causal and/or sliding-window layer, as draft_block's
    mask: q_pos [N, JB, 1], key_pos [N, 1, S+JB] absolute positions."""
    m = plain & (key_pos <= q_pos) if causal else plain
    if window is not None:
        m = m & (q_pos - key_pos < window)
        if not causal:
            m = m & (key_pos - q_pos < window)
    return m


@dataclass
class LossOutput:
    loss: torch.Tensor
    accuracy: torch.Tensor  # [B-1] per block position
    accepted: torch.Tensor  # mean accepted drafts per block (greedy, exact prefix) -> tau estimate = 1 + this
    num_blocks: int


def dflash_loss(
    drafter: DFlashDrafter,
    taps: torch.Tensor,
    blocks: BlockBatch,
    gamma: float,
    soft: torch.Tensor | None = None,
    kd_weight: float = 0.0,
) -> LossOutput:
    """Cross-entropy on block positions 1..B-1 weighted exp(-(k-1)/gamma), averaged over valid blocks.

    With soft [N, J, B-1, Vd] (teacher probabilities, distill.soft_labels) and kd_weight a, each
    position's term is (1 - a) * CE(hard label) + a * CE(soft label); a hard label outside the
    draft vocabulary then still has its soft term. Accuracy and tau_est always use hard labels.
    A family with a head of its own (train_terms) is refused: its loss is family_loss's."""
    if getattr(drafter.config.family, "train_terms", None) is not None:
        raise ConfigError(
            f"dflash_loss trains plain DFlash drafters; a {drafter.config.family.LABEL} drafter's loss is family_loss"
        )
    return _plain_loss(drafter, drafter_train_forward(drafter, taps, blocks), blocks, gamma, soft, kd_weight)


def _plain_loss(
    drafter: DFlashDrafter,
    hidden: torch.Tensor,  # [N, J, B, d]
    blocks: BlockBatch,
    gamma: float,
    soft: torch.Tensor | None = None,
    kd_weight: float = 0.0,
) -> LossOutput:
    """dflash_loss from the training forward's hidden states."""
    logits = drafter.finish_logits(drafter.head_logits(hidden[:, :, 1:]))  # [N, J, B-1, Vd]
    labels = _logit_columns(drafter, blocks.labels)
    ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none", ignore_index=-100).view_as(labels)
    if soft is not None and kd_weight > 0:
        soft_ce = -(soft.to(logits.dtype) * logits.log_softmax(-1)).sum(-1)  # [N, J, B-1]
        ce = (1.0 - kd_weight) * ce + kd_weight * soft_ce
    return _reduce(blocks, gamma, [(1.0, ce)], logits.argmax(-1), labels)


def _logit_columns(drafter: DFlashDrafter, labels: torch.Tensor) -> torch.Tensor:
    """Label token ids [N, J, B-1] -> the drafter's logit columns: the ids themselves, or with a draft
    vocabulary their indices in it (-100 outside it: no loss, never correct)."""
    if drafter.draft_vocab is None:
        return labels
    dv = drafter.draft_vocab.to(labels.device)
    idx = torch.searchsorted(dv, labels.contiguous()).clamp_max(len(dv) - 1)
    return torch.where(dv[idx] == labels, idx, torch.full_like(idx, -100))


def _reduce(blocks: BlockBatch, gamma: float, terms: list, predicted: torch.Tensor, labels: torch.Tensor):
    """Weighted loss and statistics. terms: (alpha, per-position loss [N, J, B-1]) pairs, each reduced
    as sum over valid blocks of (sum_k w_k * term_k * counts_k) / sum_k w_k, divided by the number of
    valid blocks; predicted / labels [N, J, B-1] the greedy drafts (teacher-forced) and their labels."""
    B = blocks.block_ids.shape[-1]
    w = position_weights(B, gamma).to(predicted.device)
    vmask = blocks.valid.float()
    n = vmask.sum().clamp_min(1.0)
    lmask = vmask[..., None].expand_as(labels)  # [N, J, B-1]
    if blocks.label_mask is not None:  # unlabeled positions add nothing; the per-block scale stays w.sum()
        lmask = lmask * blocks.label_mask.float()
    loss = sum(alpha * ((term * w * lmask).sum(-1) / w.sum()).sum() / n for alpha, term in terms)
    with torch.no_grad():
        correct = (predicted == labels).float() * lmask  # [N, J, B-1]
        acc = correct.sum((0, 1)) / lmask.sum((0, 1)).clamp_min(1.0)
        # an unlabeled position ends the accepted prefix: tau_est is then a lower bound
        accepted = correct.cumprod(-1).sum(-1).sum() / n
    return LossOutput(loss, acc, accepted, int(vmask.sum().item()))


def family_loss(
    drafter: DFlashDrafter,
    taps: torch.Tensor,  # [N, S, n_taps*d]
    blocks: BlockBatch,
    gamma: float,
    soft: torch.Tensor | None = None,
    kd_weight: float = 0.0,
    target_logits: torch.Tensor | None = None,
    teacher_logits: torch.Tensor | None = None,
    **options,
) -> LossOutput:
    """The training loss of the drafter's own family: dflash_loss for plain DFlash, otherwise the
    family module's train_terms (dflash_trt/families) reduced as dflash_loss reduces its CE.

    target_logits [N, S, V]: the target's logits at every sequence position (TargetModel.forward),
    for objectives that match the target's distribution (DSpark's L1 and confidence terms); soft /
    kd_weight: plain DFlash only. options: the family's own weights (see its train_terms).
    teacher_logits [N, J, B-1, V]: the same logits already gathered per block position (what the
    trainer computes, target_block_logits), in place of target_logits."""
    hidden = drafter_train_forward(drafter, taps, blocks)  # [N, J, B, d]
    terms_of = getattr(drafter.config.family, "train_terms", None)
    if terms_of is None:  # a family without a head of its own trains as plain DFlash
        return _plain_loss(drafter, hidden, blocks, gamma, soft, kd_weight)
    if soft is not None and kd_weight > 0:
        raise ConfigError(f"kd_weight={kd_weight}: soft labels are not supported for {drafter.config.family.LABEL}")
    teacher = teacher_logits
    if teacher is None and target_logits is not None:  # the target's distribution over the token of block position k
        at = blocks.positions[..., :-1].flatten(1)  # [N, J*(B-1)]: position a+k-1 predicts token a+k
        teacher = target_logits.gather(1, at[..., None].expand(-1, -1, target_logits.shape[-1]))
        teacher = teacher.view(*blocks.labels.shape, -1)  # [N, J, B-1, V]
    terms, predicted = terms_of(drafter, hidden, blocks.block_ids, blocks.labels, teacher, **options)
    return _reduce(blocks, gamma, terms, predicted, blocks.labels)


def dpace_weights(prob: torch.Tensor, mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE position weights (SpecForge 0.2.0 _dpace_weight, loss_type "dpace"), detached.
    prob [..., K] the drafter's probability of each block position's label, mask [..., K] which
    positions count: smooth = (1 - alpha) * p + alpha (1 at a masked-out position, a no-op in the
    product), prefix = cumprod(smooth), weight_k = sum_{j >= k} prefix_j * mask_j."""
    with torch.no_grad():
        m = mask.to(prob.dtype)
        smooth = torch.where(mask.bool(), (1.0 - alpha) * prob + alpha, torch.ones_like(prob))
        prefix = smooth.cumprod(-1)
        return (prefix * m).flip(-1).cumsum(-1).flip(-1)


def dpace_loss(
    drafter: DFlashDrafter, taps: torch.Tensor, blocks: BlockBatch, gamma: float, alpha: float = 0.5
) -> LossOutput:
    """Plain DFlash trained with the D-PACE objective: sum over valid labelled positions of
    -log q(label) * dpace_weights, divided by the number of sequences N (SpecForge's denominator).
    The D-PACE weights replace exp(-(k-1)/gamma); accuracy and tau_est are dflash_loss's."""
    hidden = drafter_train_forward(drafter, taps, blocks)
    logits = drafter.finish_logits(drafter.head_logits(hidden[:, :, 1:]))  # [N, J, B-1, Vd]
    labels = _logit_columns(drafter, blocks.labels)
    nll = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none", ignore_index=-100)
    nll = nll.view_as(labels)
    mask = blocks.valid[..., None].expand_as(labels) & (labels != -100)
    if blocks.label_mask is not None:
        mask = mask & blocks.label_mask
    w = dpace_weights(torch.exp(-nll.detach()), mask, alpha)
    loss = (nll * mask * w).sum() / labels.shape[0]
    stats = _reduce(blocks, gamma, [], logits.argmax(-1), labels)
    return LossOutput(loss, stats.accuracy, stats.accepted, stats.num_blocks)


# AdamW's betas. SpecForge 0.2.0 keeps torch's (0.9, 0.999); the first step is the same either way
# (Adam's bias correction), later ones differ (tests/test_train_parity_dflash.py pins it; docs/training.md)
ADAM_BETAS = (0.9, 0.95)


def make_optimizer(params: list, lr: float, weight_decay: float) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=ADAM_BETAS)


def optimizer_step(opt: torch.optim.Optimizer, params: list, lr: float, grad_clip: float) -> None:
    """One update from the gradients in params: every group at lr, the global norm clipped to
    grad_clip (coefficient grad_clip / (norm + 1e-6), as SpecForge's BF16Optimizer), then the step."""
    for g in opt.param_groups:
        g["lr"] = lr
    torch.nn.utils.clip_grad_norm_(params, grad_clip)
    opt.step()


def cosine_lr(step: int, total: int, peak: float, warmup_ratio: float) -> float:
    """The lr of optimizer step `step` (0-based) of `total`: linear warmup over int(warmup_ratio * total)
    steps (SpecForge 0.2.0's CosineAnnealingWarmupLR count, none when that is 0), then cosine to 0.
    SpecForge chains torch's recursive CosineAnnealingLR, which strays from this closed form by a
    little at the hand-over step (tests/test_train_parity_dflash.py bounds it)."""
    warm = int(warmup_ratio * total)
    if step < warm:
        return peak * (step + 1) / warm
    t = (step - warm) / max(1, total - warm)
    return peak * 0.5 * (1.0 + math.cos(math.pi * min(1.0, t)))
