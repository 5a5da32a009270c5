"""Parity of the DSpark and Domino drafter families (dflash_trt/families/dspark.py, domino.py) with
SpecForge 0.2.0's DSparkDraftModel and DominoDraftModel: a checkpoint SpecForge wrote loads; over
consecutive cached steps the hidden states, the teacher-forced corrected logits (apply_logits_head,
markov_head.sample_block_tokens) and the confidence head's sigmoid agree to 1e-5, and the greedy
draft path equals SpecForge's, for every Markov head type and both alignments and every Domino
variant; greedy generation equals SpecForge's spec_generate for drafters that accept, and the
target's greedy (batch 3, ragged, also with draft_length="confidence"); sampled output follows the
target (chi-square); saves load into SpecForge, the legacy `logit_head.` nesting and SGLang's
projector_type layout load; what is refused is refused with one line.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import fp32_tol, tiny_config, tiny_hf
from parity_common import MASK, L, edit_config, our_generate, train_until_it_accepts
from safetensors.torch import load_file, save_file

from dflash_trt.config import SamplingParams
from dflash_trt.decoding.engine import SpecEngine
from dflash_trt.errors import CheckpointError, ConfigError, DFlashError
from dflash_trt.families import domino, dspark
from dflash_trt.modeling.drafter import DFlashDrafter
from dflash_trt.modeling.target import TargetModel

sf_dspark = pytest.importorskip(
    "specforge.modeling.draft.dspark", reason="SpecForge is not installed (.venv/bin/pip install specforge==0.2.0)"
)
from specforge.modeling.draft.dflash import DFlashDraftModel as SFDFlash  # noqa: E402
from specforge.modeling.draft.dflash import extract_context_feature  # noqa: E402
from specforge.modeling.draft.domino import DominoDraftModel  # noqa: E402
from transformers import DynamicCache  # noqa: E402

DSparkDraftModel = sf_dspark.DSparkDraftModel
pytestmark = pytest.mark.reference

B = 4
STEPS = 40  # training steps of the accepting backbone
PLAIN = {"mask_token_id": MASK, "target_layer_ids": [1, 3]}
DOMINO = {"emb_dim": 16, "gru_hidden_dim": 12}


def dspark_fields(kind="rnn", anchor=True, with_markov=True, confidence=True):
    return {
        "markov_rank": 8,
        "markov_head_type": kind,
        "enable_confidence_head": confidence,
        "confidence_head_with_markov": with_markov,
        "sample_from_anchor": anchor,
    }


def sf_config(fields):
    """A tiny SpecForge drafter config (GQA: SpecForge's DSpark default needs kv heads < heads)."""
    return tiny_config(
        "qwen3",
        num_target_layers=L,
        num_hidden_layers=2,
        block_size=B,
        num_key_value_heads=2,
        dflash_config={**PLAIN, **fields},
    )


def sf_checkpoint(cls, fields, folder, head_scale=3.0, seed=0):
    """A checkpoint written by SpecForge's `cls`: random weights, the heads' scaled by head_scale so
    that they change the argmax of some positions."""
    torch.manual_seed(seed)
    model = cls(sf_config(fields)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                head = any(k in name for k in ("markov", "confidence", "gru", "embed_proj"))
                p.copy_(torch.randn_like(p) * p.shape[1] ** -0.5 * (head_scale if head else 1.0))
    model.save_pretrained(folder)
    return folder


def sf_load(cls, folder):
    model, info = cls.from_pretrained(folder, output_loading_info=True)
    return model.float().eval(), info


def pair(tmp_path, cls, fields, head_scale=3.0):
    hf = tiny_hf("qwen3", num_hidden_layers=L)
    target = TargetModel(hf)
    folder = sf_checkpoint(cls, fields, tmp_path / "sf", head_scale)
    return hf, target, DFlashDrafter.from_pretrained(folder, target=target), sf_load(cls, folder)[0], folder


def cached_steps(hf, ours, theirs):
    """Yields (block, their hidden, our hidden, our cache) over consecutive verify steps with varying
    accepted counts: SpecForge's forward on a DynamicCache as spec_generate runs it, ours on its cache."""
    toks = torch.randint(0, MASK, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        feats = extract_context_feature(hf(toks, output_hidden_states=True).hidden_states, [1, 3])
    rcache, dcache, prev, start = DynamicCache(), ours.new_cache(1, 64), 0, 12
    for accepted in (2, 0, 3, 1):
        block = torch.full((1, B), MASK)
        block[0, 0] = toks[0, start]
        with torch.no_grad():
            rh = theirs(
                target_hidden=feats[:, prev:start],
                noise_embedding=hf.model.embed_tokens(block),
                position_ids=torch.arange(prev, start + B)[None],
                past_key_values=rcache,
                use_cache=True,
                is_causal=False,
            )
        rcache.crop(start - rcache.get_seq_length())  # transformers 5 crops by a negative count
        ours.inject_context(feats[:, prev:start], torch.tensor([start - prev]), dcache)
        oh = ours.draft_block(block, dcache)
        torch.testing.assert_close(oh, rh, **fp32_tol(rh))
        yield block, rh, oh, dcache
        prev, start = start, start + accepted + 1


def _propose(drafter, block, cache, needs=frozenset()):
    from dflash_trt.decoding.verify import sample_tokens, warp_logits

    return drafter.family.propose(
        drafter, block.clone(), cache, [(SamplingParams(), None)], needs, warp_logits, sample_tokens
    )


@pytest.mark.parametrize("anchor", [True, False])
@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_dspark_states_logits_path_and_confidence_match_specforge(tmp_path, kind, anchor):
    with_markov = kind != "gated"  # the confidence head reads W1[prev] for two of the three
    hf, _, ours, theirs, _ = pair(tmp_path, DSparkDraftModel, dspark_fields(kind, anchor, with_markov))
    assert ours.family.NAME == "dspark" and ours.config.family_fields["sample_from_anchor"] is anchor
    g, differs = torch.Generator().manual_seed(3), 0
    for block, rh, oh, cache in cached_steps(hf, ours, theirs):
        sel = rh[:, : B - 1] if anchor else rh[:, 1:]  # the proposal positions of each alignment
        with torch.no_grad():
            base = hf.lm_head(sel)
            rtok, rlog = theirs.markov_head.sample_block_tokens(
                base, first_prev_token_ids=block[:, 0], hidden_states=sel
            )
            prev = torch.cat([block[:, :1], rtok[:, :-1]], 1)
            rconf = theirs.predict_confidence(sel, prev_token_ids=prev).sigmoid()
            forced = torch.randint(0, MASK, prev.shape, generator=g)  # teacher forcing off the greedy path
            rforced = theirs.apply_logits_head(base, prev_token_ids=forced, hidden_states=sel)
            ohid = dspark.proposal_hidden(ours, oh)
            torch.testing.assert_close(ohid, sel, **fp32_tol(sel))
            torch.testing.assert_close(dspark.corrected_logits(ours, ohid, prev), rlog, **fp32_tol(rlog))
            torch.testing.assert_close(dspark.corrected_logits(ours, ohid, forced), rforced, **fp32_tol(rforced))
            drafted, q, conf = _propose(ours, block, cache, frozenset({"confidence"}))
        assert q is None and drafted[0, 0] == block[0, 0] and drafted[:, 1:].tolist() == rtok.tolist()
        torch.testing.assert_close(conf["confidence"], rconf, **fp32_tol(rconf))
        differs += int((rlog.argmax(-1) != base.argmax(-1)).sum())
    assert differs  # the Markov head changed some argmax: the path compared is the head's


@pytest.mark.parametrize("prefix", [0, 1])
@pytest.mark.parametrize("shift", [False, True])
def test_domino_states_logits_and_path_match_specforge(tmp_path, shift, prefix):
    fields = {**DOMINO, "shift_label": shift, "pure_draft_prefix_len": prefix}
    hf, _, ours, theirs, _ = pair(tmp_path, DominoDraftModel, fields, head_scale=1.5)
    assert ours.family.NAME == "domino"
    g, differs = torch.Generator().manual_seed(3), 0
    pos = [t - 1 if shift else t for t in range(1, B)]  # the block position that drafts token t
    for block, rh, oh, cache in cached_steps(hf, ours, theirs):
        with torch.no_grad():
            rtok = theirs._sample_draft_tokens(hf, rh, block.clone())
            drafted, q, _ = _propose(ours, block, cache)
            base = hf.lm_head(rh)[:, pos]
            for tokens in (torch.cat([block[:, :1], rtok], 1), torch.randint(0, MASK, (1, B), generator=g)):
                rl = theirs.apply_logits_head(
                    hf.lm_head(rh)[:, None],
                    prev_token_embeddings=hf.model.embed_tokens(tokens)[:, None],
                    hidden_states=rh[:, None],
                )[:, 0, pos]
                torch.testing.assert_close(domino.corrected_logits(ours, oh, tokens), rl, **fp32_tol(rl))
                differs += int((rl.argmax(-1) != base.argmax(-1)).sum())
        assert q is None and drafted[0, 0] == block[0, 0] and drafted[:, 1:].tolist() == rtok.tolist()
    assert differs  # the GRU correction changed some argmax


@pytest.fixture
def legacy_crop(monkeypatch):
    """SpecForge 0.2.0's spec_generate calls DynamicCache.crop(length), the pre-5 transformers
    meaning; transformers 5 takes a negative count to remove and raises on a positive one."""
    crop = DynamicCache.crop
    monkeypatch.setattr(DynamicCache, "crop", lambda self, n: crop(self, n - self.get_seq_length() if n > 0 else n))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(hf, target, prompts, backbone state): a plain SpecForge DFlash drafter of the families' shape
    trained on the target's continuations of `prompts` (once for the module: the costly part)."""
    tmp = tmp_path_factory.mktemp("plain")
    hf = tiny_hf("qwen3", num_hidden_layers=L)
    target = TargetModel(hf)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, MASK, (6,), generator=g).tolist() for _ in range(4)]
    torch.manual_seed(0)
    SFDFlash(sf_config({})).float().save_pretrained(tmp / "plain")
    plain = train_until_it_accepts(DFlashDrafter.from_pretrained(tmp / "plain", target=target), target, prompts, STEPS)
    plain.save_pretrained(tmp / "trained")
    return (
        hf,
        target,
        prompts + [torch.randint(0, MASK, (5,), generator=g).tolist()],
        load_file(str(tmp / "trained" / "model.safetensors")),
    )


def accepting(folder, backbone, cls, fields):
    """A `cls` checkpoint that gets drafts accepted, built by SpecForge: the trained plain backbone
    plus small random head weights (they score, yet mostly keep the trained argmax)."""
    torch.manual_seed(0)
    model = cls(sf_config(fields)).float()
    missing, unexpected = model.load_state_dict(backbone, strict=False)
    heads = ("markov_head", "confidence_head", "prefix_gru", "embed_proj")
    assert not unexpected and missing and all(k.startswith(heads) for k in missing), (missing, unexpected)
    with torch.no_grad():
        for name in missing:
            p = model.get_parameter(name)
            p.copy_(0.05 * torch.randn_like(p))
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    "cls, fields",
    [(DominoDraftModel, DOMINO), (DSparkDraftModel, dspark_fields("rnn", anchor=False))],
    ids=["domino", "dspark_fill_in"],
)
def test_greedy_generation_matches_spec_generate(tmp_path, legacy_crop, trained, cls, fields):
    hf, target, prompts, backbone = trained
    folder = accepting(tmp_path / "acc", backbone, cls, fields)
    ours, theirs = DFlashDrafter.from_pretrained(folder, target=target), sf_load(cls, folder)[0]
    steps, n = [], 16
    for prompt in prompts[:2] + prompts[4:]:
        tokens, per_step = our_generate(target, ours, prompt, n)
        assert MASK not in tokens  # spec_generate drops mask ids from its output
        with torch.no_grad():
            res = theirs.spec_generate(
                target=hf, input_ids=torch.tensor([prompt]), max_new_tokens=n, stop_token_ids=None, temperature=0.0
            )
        assert tokens == res[0, len(prompt) :].tolist()
        steps += per_step
    assert sum(k > 1 for k in steps) >= 6, steps  # drafts do get accepted: the comparison has teeth


def engine_generate(target, drafter, prompts, params, **engine_kw):
    """loop.generate with SpecEngine keyword arguments it does not pass (draft_length) -> (tokens, stats)."""
    from dflash_trt.decoding.stats import DecodeStats

    eng = SpecEngine(target, drafter, max_batch=len(prompts), max_seq_len=64, kernels="torch", **engine_kw)
    seed = params.seed
    eng.add_requests(
        [
            (str(r), p, dataclasses.replace(params, seed=None if seed is None else seed + r))
            for r, p in enumerate(prompts)
        ]
    )
    tokens, stats = {str(r): [] for r in range(len(prompts))}, DecodeStats()
    while eng.has_unfinished():
        for out in eng.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                stats.add(out.stats)
    return [tokens[str(r)] for r in range(len(prompts))], stats


@pytest.mark.parametrize("family", ["dspark", "domino", "dspark_confidence"])
def test_greedy_batch_equals_target_greedy(tmp_path, family):
    from dflash_trt.decoding.loop import generate, generate_baseline

    cls, fields = (DominoDraftModel, DOMINO) if family == "domino" else (DSparkDraftModel, dspark_fields("rnn"))
    _, target, ours, _, _ = pair(tmp_path, cls, fields)
    prompts, params = [[1, 2, 3, 4, 5], [9, 8, 7], [11, 12, 13, 14, 15, 16, 17]], SamplingParams(max_new_tokens=14)
    want = generate_baseline(target, prompts, params).tokens
    if family != "dspark_confidence":
        assert generate(target, ours, prompts, params).tokens == want
        return
    tokens, stats = engine_generate(target, ours, prompts, params, draft_length="confidence", draft_cutoff=0.3)
    assert tokens == want
    assert stats.num_draft_tokens < (B - 1) * stats.num_verify_steps  # the confidence length acted
    assert stats.predicted_tau is not None and len(stats.predicted_per_position) == B - 1


@pytest.mark.parametrize("family", ["dspark", "domino", "dspark_confidence"])
def test_sampled_distribution_equals_target(family):
    """Lossless with the sequential q (each draft's q reads the drafts before it), and with a draft
    length the confidence head sets before each draft is drawn: tokens 2 and 3 follow the target's
    own distribution (chi-square over N rows, as test_loop's)."""
    from test_loop import assert_follows_target

    from dflash_trt.config import DrafterConfig

    V, N, prompt = 12, 600, [3, 1, 4]  # fewer rows than test_loop: the sequential heads draw per row
    t = TargetModel(tiny_hf("qwen3", vocab_size=V))
    with torch.no_grad():
        t.lm_head.weight.mul_(8.0)
    cfg = DrafterConfig.for_target(t.config, num_layers=1, block_size=B)
    if family == "domino":
        arch, fields = "DominoDraftModel", {**domino.DEFAULTS, **DOMINO}
    else:
        arch, fields = "DSparkDraftModel", {**dspark.DEFAULTS, **dspark_fields("gated")}
    cfg = dataclasses.replace(cfg, architectures=[arch], family_fields=fields)
    torch.manual_seed(1)
    d = DFlashDrafter(cfg)
    with torch.no_grad():
        for p in d.parameters():
            p.normal_(0, 3.0 * p.shape[-1] ** -0.5)
    d = d.float().bind(t)
    params = SamplingParams(temperature=1.0, max_new_tokens=3, seed=7, ignore_eos=True)
    kw = {"draft_length": "confidence", "draft_cutoff": 0.3} if family == "dspark_confidence" else {}
    tokens, stats = engine_generate(t, d, [prompt] * N, params, **kw)
    assert 0.05 < stats.acceptance_rate < 0.95, stats.acceptance_rate
    if kw:
        assert stats.num_draft_tokens < (B - 1) * stats.num_verify_steps  # the length rule acted
    assert_follows_target(t, prompt, V, tokens)


@pytest.mark.parametrize(
    "cls, fields", [(DSparkDraftModel, dspark_fields("gated")), (DominoDraftModel, DOMINO)], ids=["dspark", "domino"]
)
def test_save_load_round_trip(tmp_path, cls, fields):
    _, target, ours, _, folder = pair(tmp_path, cls, fields)
    ours.save_pretrained(tmp_path / "ours")
    saved = load_file(str(tmp_path / "ours" / "model.safetensors"))
    theirs, info = sf_load(cls, tmp_path / "ours")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    for k, v in theirs.state_dict().items():
        assert torch.equal(saved[k], v), k
    again = DFlashDrafter.from_pretrained(tmp_path / "ours", target=target)
    for k, v in ours.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k
    assert again.config.family_fields == ours.config.family_fields
    assert {k: again.config.family_fields[k] for k in fields} == fields
    # the early SpecForge layout: the heads nested under logit_head.
    state = load_file(str(folder / "model.safetensors"))
    heads = ("markov_head", "confidence_head", "prefix_gru", "embed_proj")
    save_file(
        {("logit_head." + k if k.startswith(heads) else k): v for k, v in state.items()},
        str(folder / "model.safetensors"),
    )
    legacy = DFlashDrafter.from_pretrained(folder, target=target)
    for k, v in ours.state_dict().items():
        assert torch.equal(legacy.state_dict()[k], v), k


def test_sglang_domino_layout_loads(tmp_path):
    """SGLang's layout: architectures DFlashDraftModel, the family named by dflash_config.projector_type."""
    _, target, ours, _, folder = pair(tmp_path, DominoDraftModel, DOMINO)
    edit_config(folder, architectures=["DFlashDraftModel"])
    sglang = DFlashDrafter.from_pretrained(folder, target=target)
    assert sglang.family.NAME == "domino" and sglang.config.family_fields == ours.config.family_fields
    for k, v in ours.state_dict().items():
        assert torch.equal(sglang.state_dict()[k], v), k


def _refused(folder, error, match, **changes):
    if changes:
        edit_config(folder, **changes)
    with pytest.raises(error, match=match) as e:
        DFlashDrafter.from_pretrained(folder)
    assert "\n" not in str(e.value)


def test_refusals_are_one_line(tmp_path):
    _, target, ours, _, folder = pair(tmp_path, DSparkDraftModel, dspark_fields("rnn"))
    with pytest.raises(ConfigError, match="draft_length=confidence needs draft_cutoff > 0") as e:
        SpecEngine(target, ours, kernels="torch", draft_length="confidence", draft_cutoff=0.0)
    assert "\n" not in str(e.value)
    _refused(
        folder, ConfigError, "markov_head_type='lstm': choose one of", **{"dflash_config.markov_head_type": "lstm"}
    )
    _refused(folder, ConfigError, "markov_rank=-1: must be an integer >= 0", **{"dflash_config.markov_rank": -1})
    edit_config(folder, **{"dflash_config.markov_head_type": "rnn", "dflash_config.markov_rank": 0})
    _refused(folder, ConfigError, "confidence_head_with_markov=true needs markov_rank > 0", markov_rank=0)
    edit_config(folder, markov_rank=8, **{"dflash_config.markov_rank": 8})
    _refused(
        folder, ConfigError, "draft vocabularies are not supported for DSpark", **{"dflash_config.draft_vocab_size": 8}
    )
    edit_config(folder, **{"dflash_config.draft_vocab_size": None})
    _refused(
        folder,
        ConfigError,
        "projector_type='domino': a DSpark drafter has 'dspark'",
        **{"dflash_config.projector_type": "domino"},
    )
    edit_config(folder, **{"dflash_config.projector_type": "dspark"})
    DFlashDrafter.from_pretrained(folder)  # the edits are undone: what follows is refused for its own reason
    state = load_file(str(folder / "model.safetensors"))
    del state["markov_head.markov_w2.weight"]
    save_file(state, str(folder / "model.safetensors"))
    _refused(folder, CheckpointError, r"markov_head\.markov_w2\.weight")
    # a DSpark drafter without the confidence head has no confidence to set the length from
    _, target, plain, _, _ = pair(
        tmp_path / "noconf", DSparkDraftModel, dspark_fields("vanilla", with_markov=False, confidence=False)
    )
    with pytest.raises(DFlashError, match="draft_length=confidence: this DSpark drafter has no confidence head") as e:
        SpecEngine(target, plain, kernels="torch", draft_length="confidence", draft_cutoff=0.3)
    assert "\n" not in str(e.value)
    folder = sf_checkpoint(DominoDraftModel, DOMINO, tmp_path / "dom")
    _refused(
        folder,
        ConfigError,
        r"pure_draft_prefix_len=3: must be an integer in 0\.\.2",
        **{"dflash_config.pure_draft_prefix_len": B - 1},
    )
