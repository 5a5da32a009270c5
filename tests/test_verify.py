"""Acceptance math on hand-built logits, and the lossless property of rejection sampling."""

import pytest
import torch
from scipy.stats import chisquare

from dflash_trt.config import SamplingParams
from dflash_trt.decoding.verify import greedy_accept, rejection_accept, sample_tokens, warp_logits
from dflash_trt.errors import ConfigError


def test_greedy_accept_hand_built():
    # block [x0, d1, d2, d3]; argmax[i] judges d_{i+1}
    draft = torch.tensor([[5, 1, 2, 3], [5, 1, 2, 3], [5, 9, 2, 3], [5, 1, 2, 3]])
    argmax = torch.tensor([[1, 2, 3, 7], [1, 2, 8, 7], [1, 2, 3, 7], [1, 4, 3, 6]])
    v = greedy_accept(draft, argmax)
    assert v.accepted.tolist() == [3, 2, 0, 1]
    assert v.bonus.tolist() == [7, 8, 1, 4]


def test_greedy_accept_from_logits_is_target_greedy():
    V, B = 11, 5
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, B, V, generator=gen)
    target = logits.argmax(-1)  # target[:, i] judges draft[:, i + 1]
    draft = torch.randint(0, V, (3, B), generator=gen)
    draft[:, 1:] = target[:, :-1]  # every draft correct ...
    draft[1, 3] = (target[1, 2] + 1) % V  # ... except row 1's third (2 accepted)
    draft[2, 1] = (target[2, 0] + 1) % V  # ... and row 2's first (none accepted)
    v = greedy_accept(draft, target)
    assert v.accepted.tolist() == [B - 1, 2, 0]
    # the bonus is the target's own token at the first rejected slot (after the last, if none was)
    assert v.bonus.tolist() == [int(target[0, B - 1]), int(target[1, 2]), int(target[2, 0])]


def chi2_pvalue(counts, probs):
    probs = probs.double().numpy()
    return chisquare(counts, probs / probs.sum() * counts.sum()).pvalue


def _probs(V, gen):
    return torch.softmax(torch.randn(V, generator=gen) * 1.5, -1)


def test_rejection_sampling_matches_target_distribution():
    """Emitted first token ~ p, whatever q proposed (chi-square at fixed seed)."""
    gen = torch.Generator().manual_seed(0)
    V, B, N = 6, 3, 40000
    p = torch.stack([_probs(V, gen) for _ in range(B)])  # [B, V]
    q = torch.stack([_probs(V, gen) for _ in range(B - 1)])  # [B-1, V]
    drafts = torch.stack([torch.multinomial(q[i], N, replacement=True, generator=gen) for i in range(B - 1)], 1)
    block = torch.cat([torch.zeros(N, 1, dtype=torch.long), drafts], 1)
    v = rejection_accept(
        block,
        p.expand(N, B, V),
        q.expand(N, B - 1, V),
        torch.rand(N, B - 1, generator=gen),
        torch.rand(N, generator=gen),
    )
    first = torch.where(v.accepted > 0, block[:, 1], v.bonus)  # token emitted at slot 1
    counts = torch.bincount(first, minlength=V).numpy()
    assert chi2_pvalue(counts, p[0]) > 1e-3
    # second emitted token given first == each value: check the unconditional second slot when d1 accepted
    sel = v.accepted >= 1
    second = torch.where(v.accepted[sel] > 1, block[sel, 2], v.bonus[sel])
    counts2 = torch.bincount(second, minlength=V).numpy()
    assert chi2_pvalue(counts2, p[1]) > 1e-3


def test_no_drafts_is_a_plain_step():
    """A block of the last token alone (a gated step with no sure draft): greedy gives the argmax,
    rejection sampling a sample from p by the same inverse CDF as sample_tokens."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 1, 7, generator=gen)
    block = torch.randint(0, 7, (3, 1), generator=gen)
    v = greedy_accept(block, logits.argmax(-1))
    assert v.accepted.tolist() == [0, 0, 0] and torch.equal(v.bonus, logits[:, 0].argmax(-1))
    p = logits.softmax(-1)
    u = torch.tensor([0.0, 0.5, 1.0 - 1e-7])
    v = rejection_accept(block, p, p[:, :0], torch.rand(3, 0), u)
    cdf = p[:, 0].cumsum(-1)
    want = [int((cdf[r] <= u[r] * cdf[r, -1]).sum().clamp(max=6)) for r in range(3)]
    assert v.accepted.tolist() == [0, 0, 0] and v.bonus.tolist() == want


def test_rejection_with_q_equal_p_accepts_all():
    V, B = 5, 4
    p = torch.softmax(torch.randn(1, B, V), -1)
    block = torch.tensor([[0, 1, 2, 3]])
    v = rejection_accept(block, p, p[:, :-1], torch.rand(1, B - 1) * 0.999, torch.tensor([0.5]))
    assert v.accepted.item() == B - 1


def test_rejection_deterministic_given_uniforms():
    gen = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(4, 5, 9, generator=gen), -1)
    q = torch.softmax(torch.randn(4, 4, 9, generator=gen), -1)
    block = torch.randint(0, 9, (4, 5), generator=gen)
    u, u2 = torch.rand(4, 4, generator=gen), torch.rand(4, generator=gen)
    a, b = rejection_accept(block, p, q, u, u2), rejection_accept(block, p, q, u, u2)
    assert torch.equal(a.accepted, b.accepted) and torch.equal(a.bonus, b.bonus)


def test_warp_top_k_top_p():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    pk = warp_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (pk[0, 2:] == 0).all() and torch.isclose(pk.sum(), torch.tensor(1.0))
    full = logits.softmax(-1)[0]
    pp = warp_logits(logits, SamplingParams(temperature=1.0, top_p=float(full[0] + 1e-3)))
    assert (pp[0, 2:] == 0).all() and pp[0, 1] > 0  # second token needed to pass the mass
    pt = warp_logits(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(pt, (logits / 0.5).softmax(-1))


def test_sample_tokens_seeded():
    probs = torch.softmax(torch.randn(3, 50), -1)
    a = sample_tokens(probs, torch.Generator().manual_seed(7))
    b = sample_tokens(probs, torch.Generator().manual_seed(7))
    assert torch.equal(a, b)


@pytest.mark.parametrize(
    "field,value", [("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("max_new_tokens", 0), ("top_k", -2)]
)
def test_sampling_params_errors_name_field(field, value):
    with pytest.raises(ConfigError, match=field):
        SamplingParams(**{field: value})
