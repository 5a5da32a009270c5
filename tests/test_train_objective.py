"""The training mask against per-block inference, and the weighted loss by hand."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import fp32_tol, tiny_drafter, tiny_target

from dflash_trt.train.objective import (
    block_mask,
    default_gamma,
    dflash_loss,
    drafter_train_forward,
    make_blocks,
    position_weights,
    sample_anchors,
)


def _setup(B=4):
    t = tiny_target("qwen3")
    d = tiny_drafter(t, block_size=B)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, 20), generator=gen)
    cache = t.new_cache(2, 20)
    taps = t.forward(ids, cache, tap_layers=d.target_layer_ids).taps
    return t, d, ids, taps


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"is_causal": True, "input_embedding_scale": 1.5},
        {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 2},  # causal window
        {"is_causal": False, "layer_types": ["sliding_attention"] * 2, "sliding_window": 3},  # both sides
    ],
)
def test_each_block_equals_separate_inference_forward(fields):
    t, d, ids, taps = _setup(B=4)
    for k, v in fields.items():  # z-lab attention / embedding fields: training masks as inference does
        setattr(d.config, k, v)
    anchors, valid = sample_anchors([20, 15], [3, 5], num=5, block_size=4, generator=torch.Generator().manual_seed(1))
    assert valid.all() and (anchors[1] <= 11).all() and (anchors >= 3).all()
    blocks = make_blocks(ids, anchors, valid, 4, d.mask_token_id)
    hidden = drafter_train_forward(d, taps, blocks)  # [N, J, B, d]
    for r in range(2):
        for j in range(5):
            a = int(anchors[r, j])
            cache = d.new_cache(1, 32)
            d.inject_context(taps[r : r + 1, :a], torch.tensor([a]), cache)
            ref = d.draft_block(blocks.block_ids[r, j][None], cache)[0]
            torch.testing.assert_close(hidden[r, j], ref, **fp32_tol(ref))
    assert torch.equal(blocks.labels[0, 0], ids[0, anchors[0, 0] + 1 : anchors[0, 0] + 4])


def test_mask_shape_and_isolation():
    m = block_mask(torch.tensor([[2, 5]]), torch.tensor([[True, True]]), S=8, B=3)
    assert m.shape == (1, 6, 14)
    assert m[0, 0, :8].tolist() == [True, True] + [False] * 6  # block 0 sees positions < 2
    assert m[0, 3, :8].tolist() == [True] * 5 + [False] * 3
    assert m[0, 0, 8:].tolist() == [True] * 3 + [False] * 3  # never the other block


def test_weighted_loss_by_hand():
    t, d, ids, taps = _setup(B=4)
    anchors, valid = torch.tensor([[4, 9], [6, 0]]), torch.tensor([[True, True], [True, False]])
    blocks = make_blocks(ids, anchors, valid, 4, d.mask_token_id)
    out = dflash_loss(d, taps, blocks, gamma=7.0)
    hidden = drafter_train_forward(d, taps, blocks)
    total, n = 0.0, 0
    for r, j in [(0, 0), (0, 1), (1, 0)]:
        logits = t.lm_head(hidden[r, j, 1:])
        num = sum(
            math.exp(-(k - 1) / 7.0) * F.cross_entropy(logits[k - 1], blocks.labels[r, j, k - 1]).item()
            for k in range(1, 4)
        )
        total += num / sum(math.exp(-(k - 1) / 7.0) for k in range(1, 4))
        n += 1
    assert math.isclose(out.loss.item(), total / n, rel_tol=1e-5)
    assert out.num_blocks == 3


def test_gamma_table():
    assert default_gamma(16) == 7.0 and default_gamma(10) == 5.0 and default_gamma(8) == 4.0
    assert torch.allclose(position_weights(4, 7.0), torch.tensor([1.0, math.exp(-1 / 7), math.exp(-2 / 7)]))


def test_soft_labels_are_the_targets_distribution_at_the_previous_position():
    from test_draft_vocab import _drafter as _draft_vocab_drafter

    from dflash_trt.train.distill import feature_layers, soft_labels, split_features

    t, d, ids, _ = _setup(B=4)
    L = t.config.num_hidden_layers
    layers = feature_layers(d.target_layer_ids, L, kd=True)
    assert layers == list(d.target_layer_ids) + [L - 1]
    feats = t.forward(ids, t.new_cache(2, 20), tap_layers=layers).taps
    taps, teacher = split_features(feats, len(d.target_layer_ids), t.config.hidden_size)
    assert teacher is not None and taps.shape[-1] == len(d.target_layer_ids) * t.config.hidden_size
    full = t.forward(ids, t.new_cache(2, 20)).logits  # [2, 20, V]: logits at every position
    blocks = make_blocks(ids, torch.tensor([[4, 9], [6, 12]]), torch.ones(2, 2, dtype=torch.bool), 4, d.mask_token_id)
    vocab = torch.tensor([1, 5, 17, 40, 200])
    for dv, drafter in ((None, d), (vocab, _draft_vocab_drafter(t, vocab=vocab))):
        p = soft_labels(drafter, teacher, blocks.positions)
        for r, j, k in [(0, 0, 1), (0, 1, 3), (1, 1, 2)]:
            a = int(blocks.anchors[r, j])
            ref = full[r, a + k - 1] if dv is None else full[r, a + k - 1, dv]
            torch.testing.assert_close(p[r, j, k - 1], ref.softmax(-1), atol=1e-5, rtol=1e-4)
    with torch.no_grad():
        greedy = full.argmax(-1)
    # the teacher's argmax at position k is the target's greedy token after x_{..a+k-1}
    assert torch.equal(soft_labels(d, teacher, blocks.positions).argmax(-1)[0, 0], greedy[0, 4:7])


def test_soft_label_loss_by_hand():
    t, d, ids, taps = _setup(B=4)
    anchors, valid = torch.tensor([[4, 9], [6, 0]]), torch.tensor([[True, True], [True, False]])
    blocks = make_blocks(ids, anchors, valid, 4, d.mask_token_id)
    V = t.config.vocab_size
    soft = torch.distributions.Dirichlet(torch.ones(V)).sample((2, 2, 3))  # [N, J, B-1, V]
    a = 0.3
    out = dflash_loss(d, taps, blocks, gamma=7.0, soft=soft, kd_weight=a)
    hidden = drafter_train_forward(d, taps, blocks)
    total, n = 0.0, 0
    for r, j in [(0, 0), (0, 1), (1, 0)]:
        logp = t.lm_head(hidden[r, j, 1:]).float().log_softmax(-1)
        num = 0.0
        for k in range(1, 4):
            hard = -logp[k - 1, blocks.labels[r, j, k - 1]].item()
            sft = -(soft[r, j, k - 1] * logp[k - 1]).sum().item()
            num += math.exp(-(k - 1) / 7.0) * ((1 - a) * hard + a * sft)
        total += num / sum(math.exp(-(k - 1) / 7.0) for k in range(1, 4))
        n += 1
    assert math.isclose(out.loss.item(), total / n, rel_tol=1e-5)
    # one-hot soft labels at full weight are the hard loss
    onehot = F.one_hot(blocks.labels, V).float()
    hard = dflash_loss(d, taps, blocks, gamma=7.0)
    assert math.isclose(dflash_loss(d, taps, blocks, 7.0, onehot, 1.0).loss.item(), hard.loss.item(), rel_tol=1e-5)
