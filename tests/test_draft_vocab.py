"""Reduced draft vocabulary: checkpoint round trip, logits masking, loss, losslessness."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from conftest import fp32_tol, tiny_target
from test_loop import assert_follows_target

from dflash_trt.config import DrafterConfig, SamplingParams
from dflash_trt.decoding.loop import generate, generate_baseline
from dflash_trt.errors import CheckpointError, ConfigError
from dflash_trt.modeling.drafter import DFlashDrafter
from dflash_trt.train.objective import dflash_loss, drafter_train_forward, make_blocks
from dflash_trt.train.trainer import frequent_tokens

VOCAB = torch.tensor([3, 7, 10, 42, 99, 100, 200, 255])


def _drafter(target, B=4, vocab=VOCAB, seed=1):
    cfg = DrafterConfig.for_target(target.config, num_layers=1, block_size=B)
    cfg = dataclasses.replace(cfg, draft_vocab_size=len(vocab))
    torch.manual_seed(seed)
    d = DFlashDrafter(cfg)
    with torch.no_grad():
        d.draft_vocab.copy_(vocab)
        for p in d.parameters():
            if p.dim() == 2:
                p.normal_(0, p.shape[1] ** -0.5)
    return d.float().bind(target)


def test_round_trip_and_config_field(tmp_path):
    t = tiny_target("qwen3")
    d = _drafter(t)
    d.save_pretrained(tmp_path / "d")
    cfg = DrafterConfig.load(tmp_path / "d")
    assert cfg.draft_vocab_size == len(VOCAB) and cfg.to_json_dict()["dflash_config"]["draft_vocab_size"] == 8
    e = DFlashDrafter.from_pretrained(tmp_path / "d", target=t, dtype=torch.float32)
    assert torch.equal(e.draft_vocab, VOCAB)
    with pytest.raises(ConfigError, match="draft_vocab_size"):
        dataclasses.replace(cfg, draft_vocab_size=10_000)


def test_unsorted_vocab_rejected(tmp_path):
    t = tiny_target("qwen3")
    _drafter(t, vocab=torch.tensor([7, 3, 10, 42, 99, 100, 200, 255])).save_pretrained(tmp_path / "d")
    with pytest.raises(CheckpointError, match="draft_vocab"):
        DFlashDrafter.from_pretrained(tmp_path / "d")


def test_draft_logits_cover_only_the_vocab():
    t = tiny_target("qwen3")
    d = _drafter(t)
    cache = d.new_cache(2, 16)
    taps = torch.randn(2, 5, d.config.num_taps * 64)
    d.inject_context(taps, torch.tensor([5, 3]), cache)
    logits = d.draft_logits(torch.tensor([[5, 1, 1, 1], [6, 1, 1, 1]]), cache)  # [2, 3, 256]
    finite = torch.isfinite(logits)
    assert finite[..., VOCAB].all() and finite.sum(-1).eq(len(VOCAB)).all()
    hidden = d.draft_block(torch.tensor([[5, 1, 1, 1], [6, 1, 1, 1]]), cache)[:, 1:]
    full = t.lm_head(hidden)
    torch.testing.assert_close(logits[..., VOCAB], full[..., VOCAB], **fp32_tol(full[..., VOCAB]))
    compact = d.draft_logits(torch.tensor([[5, 1, 1, 1], [6, 1, 1, 1]]), cache, full_vocab=False)  # [2, 3, Vd]
    assert torch.equal(compact, logits[..., VOCAB])  # the engine's greedy path: same logits, no scatter
    assert torch.equal(d.draft_vocab[compact.argmax(-1)], logits.argmax(-1))


def test_loss_is_cross_entropy_over_the_vocab():
    t = tiny_target("qwen3")
    d = _drafter(t)
    ids = VOCAB[torch.randint(0, len(VOCAB), (1, 12), generator=torch.Generator().manual_seed(0))]
    ids[0, 6] = 5  # a label outside the draft vocabulary: no loss, never counted correct
    taps = t.forward(ids, t.new_cache(1, 12), tap_layers=d.target_layer_ids).taps
    blocks = make_blocks(ids, torch.tensor([[4]]), torch.tensor([[True]]), 4, d.mask_token_id)
    out = dflash_loss(d, taps, blocks, gamma=7.0)
    hidden = drafter_train_forward(d, taps, blocks)[0, 0, 1:]
    logits = t.lm_head(hidden)[:, VOCAB]
    labels = blocks.labels[0, 0]
    w = torch.exp(-torch.arange(3.0) / 7.0)
    ce = torch.stack(
        [
            (
                F.cross_entropy(logits[k], (VOCAB == labels[k]).nonzero()[0, 0])
                if labels[k] in VOCAB
                else torch.tensor(0.0)
            )
            for k in range(3)
        ]
    )
    assert labels[1] == 5
    torch.testing.assert_close(out.loss, (ce * w).sum() / w.sum())
    assert out.accuracy[1] == 0


@pytest.mark.parametrize("cutoff", [0.0, 0.2])
def test_greedy_generation_equals_baseline(cutoff):
    t = tiny_target("llama")
    d = _drafter(t, B=4)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    params = SamplingParams(max_new_tokens=20)
    out = generate(t, d, prompts, params, draft_cutoff=cutoff)
    assert out.tokens == generate_baseline(t, prompts, params).tokens


def test_sampled_distribution_equals_target_with_zero_draft_mass():
    """Tokens outside the draft vocab have q = 0: rejection sampling must still give exactly p."""
    V, N, prompt = 12, 3000, [3, 1, 4]
    t = tiny_target("qwen3", vocab_size=V)
    with torch.no_grad():
        t.lm_head.weight.mul_(8.0)
    d = _drafter(t, B=4, vocab=torch.tensor([0, 2, 5, 7, 11]))
    with torch.no_grad():
        for p in d.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    out = generate(t, d, [prompt] * N, SamplingParams(temperature=1.0, max_new_tokens=3, seed=7, ignore_eos=True))
    assert 0.05 < out.stats.acceptance_rate < 0.95
    assert_follows_target(t, prompt, V, out.tokens)


def test_frequent_tokens():
    seqs = [{"input_ids": [1, 2, 5, 5, 6], "prompt_len": 2}, {"input_ids": [9, 6, 5, 7], "prompt_len": 1}]
    assert frequent_tokens(seqs, 2).tolist() == [5, 6]
    assert frequent_tokens(seqs, 10).tolist() == [5, 6, 7]


def test_logit_fields_apply_on_the_greedy_shortcut():
    """output_multiplier / final_logit_softcapping shape the draft logits on the engine's greedy
    draft-vocab shortcut (argmax over Vd columns) exactly as on the full-vocab path."""
    from dflash_trt.decoding.engine import SpecEngine

    t = tiny_target("qwen3")
    d = _drafter(t)
    d.config.output_multiplier, d.config.final_logit_softcapping = -1.0, 2.0  # -1 turns argmax into argmin
    eng = SpecEngine(t, d, max_batch=2, max_seq_len=32, kernels="torch")
    eng.add_requests([("a", [1, 2, 3], SamplingParams()), ("b", [4, 5], SamplingParams())])
    prop = eng.propose()
    block, q = prop.block, prop.q
    masked = block.clone()
    masked[:, 1:] = d.mask_token_id  # what was drafted from (propose writes its drafts into block)
    full = d.draft_logits(masked, eng.dcache)  # [2, B-1, V]: -inf outside the vocabulary
    assert q is None and torch.equal(block[:, 1:], full.argmax(-1))
    plain = d.head_logits(d.draft_block(masked, eng.dcache)[:, 1:])  # [2, B-1, Vd] without the fields
    assert not torch.equal(block[:, 1:], VOCAB[plain.argmax(-1)])
