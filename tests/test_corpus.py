"""Teacher-forced data from existing text (corpus.py): labels and label mask by hand, scoring against
a plain forward, resume, bad input, and that training on scored text teaches greedy drafting."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_drafter, tiny_target

from dflash_trt.config import DrafterConfig, SamplingParams
from dflash_trt.decoding.loop import generate, generate_baseline
from dflash_trt.errors import DFlashError
from dflash_trt.modeling.drafter import DFlashDrafter
from dflash_trt.train.corpus import agreement, chunk_texts, greedy_next, load_texts, score_corpus
from dflash_trt.train.data import read_sequences
from dflash_trt.train.objective import dflash_loss, drafter_train_forward, make_blocks, next_tokens, position_weights
from dflash_trt.train.trainer import TrainConfig, train


class SpaceTokenizer:
    """Text "3 17 5" <-> ids [3, 17, 5]: lets tests write token sequences as text."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [int(w) for w in text.split()]}


def _text(ids):
    return " ".join(map(str, ids))


def test_labels_and_mask_by_hand():
    ids = torch.arange(10, 20)[None]  # x_t = 10 + t
    nxt = torch.full((1, 10), 99)
    nxt[0, 2], nxt[0, 3], nxt[0, 4] = 13, 98, 97  # the target agrees with x_3 only
    nxt[0, 5], nxt[0, 6], nxt[0, 7] = 16, 17, 18  # ... and with x_6, x_7, x_8
    blocks = make_blocks(ids, torch.tensor([[2, 5]]), torch.tensor([[True, True]]), 4, 0, nxt)
    assert blocks.labels.tolist() == [[[13, 98, 97], [16, 17, 18]]]
    assert blocks.label_mask.tolist() == [[[True, True, False], [True, True, True]]]
    nxt[0, 5] = 50  # x_6 is no longer the greedy token: only position 1 counts
    blocks = make_blocks(ids, torch.tensor([[5]]), torch.tensor([[True]]), 4, 0, nxt)
    assert blocks.label_mask.tolist() == [[[True, False, False]]] and blocks.labels[0, 0, 0] == 50


def test_masked_loss_by_hand_and_greedy_text_equals_plain_labels():
    t = tiny_target("qwen3")
    d = tiny_drafter(t, block_size=4)
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    taps = t.forward(ids, t.new_cache(1, 16), tap_layers=d.target_layer_ids).taps
    anchors, valid = torch.tensor([[3, 8]]), torch.tensor([[True, True]])
    nxt = torch.cat([ids[:, 1:], torch.zeros(1, 1, dtype=torch.long)], 1)  # text that is its own greedy output
    plain, forced = make_blocks(ids, anchors, valid, 4, d.mask_token_id), make_blocks(
        ids, anchors, valid, 4, d.mask_token_id, nxt
    )
    assert torch.equal(plain.labels, forced.labels) and forced.label_mask.all()
    a, b = dflash_loss(d, taps, plain, 7.0), dflash_loss(d, taps, forced, 7.0)
    assert torch.equal(a.loss, b.loss) and torch.equal(a.accuracy, b.accuracy) and torch.equal(a.accepted, b.accepted)

    nxt[0, 9] = (ids[0, 10] + 1) % 256  # block 2: x_10 disagrees -> only positions 1 and 2 count
    blocks = make_blocks(ids, anchors, valid, 4, d.mask_token_id, nxt)
    out = dflash_loss(d, taps, blocks, 7.0)
    hidden = drafter_train_forward(d, taps, blocks)
    w = position_weights(4, 7.0)
    total = 0.0
    for j, ks in [(0, (1, 2, 3)), (1, (1, 2))]:
        logits = t.lm_head(hidden[0, j, 1:])
        total += (
            sum(w[k - 1].item() * F.cross_entropy(logits[k - 1], blocks.labels[0, j, k - 1]).item() for k in ks)
            / w.sum().item()
        )
    assert math.isclose(out.loss.item(), total / 2, rel_tol=1e-5)


def test_score_corpus_equals_plain_forward_and_resumes(tmp_path):
    t = tiny_target("llama")
    g = torch.Generator().manual_seed(0)
    texts = [_text(torch.randint(0, 256, (n,), generator=g).tolist()) for n in (150, 90, 40, 200)]
    chunks = chunk_texts(SpaceTokenizer(), texts, 64)
    assert [len(c) for c in chunks] == [64] * 6  # tails under 64 tokens (and the 40-token text) dropped
    words = [t.split() for t in texts]
    starts = [(0, 0), (1, 0), (3, 0), (0, 64), (3, 64), (3, 128)]  # round-robin: window 0 of every text first
    assert chunks == [[int(w) for w in words[i][a : a + 64]] for i, a in starts]
    assert chunk_texts(SpaceTokenizer(), texts, 64, limit=2) == chunks[:2]
    out = score_corpus(
        t, SpaceTokenizer(), texts, tmp_path / "c", seq_len=64, batch_size=4, shard_size=4, progress=False
    )
    seqs = read_sequences(out)
    assert [s["input_ids"] for s in seqs] == chunks and all(s["prompt_len"] == 1 for s in seqs)
    for s in seqs:  # batched and padded scoring == each window alone
        ids = torch.tensor([s["input_ids"]])
        ref = t.forward(ids, t.new_cache(1, ids.shape[1])).logits.argmax(-1)[0].tolist()
        assert s["target_next"] == ref
    assert greedy_next(t, chunks[:3], chunk=16) == [s["target_next"] for s in seqs[:3]]  # LM head in chunks
    first = (out / "data-00001.jsonl").read_text()
    (out / "data-00001.jsonl").write_text(first.splitlines()[0] + "\n")  # an interrupted last shard
    score_corpus(t, SpaceTokenizer(), texts, out, seq_len=64, batch_size=4, shard_size=4, progress=False)
    assert (out / "data-00001.jsonl").read_text() == first
    assert 0.0 <= agreement(seqs) <= 1.0 and agreement([{"input_ids": [1, 2], "prompt_len": 1}]) is None

    line = json.loads(first.splitlines()[0])
    line["target_next"] = line["target_next"][:-1]
    (out / "data-00001.jsonl").write_text(json.dumps(line) + "\n")
    with pytest.raises(DFlashError, match="target_next must list one token per input_ids entry"):
        read_sequences(out)
    with pytest.raises(DFlashError, match="not a file or folder and not a built-in source"):
        load_texts(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DFlashError, match="no text in it"):
        load_texts(str(tmp_path / "empty"))


def test_stdlib_source_is_a_text_source():
    texts = load_texts("stdlib-src")
    assert len(texts) > 50 and any("def dedent(" in x for x in texts)  # textwrap's own source


def test_next_tokens_for_mixed_batches():
    regen, scored = {"input_ids": [5, 6, 7], "prompt_len": 1}, {
        "input_ids": [1, 2],
        "prompt_len": 1,
        "target_next": [9, 8],
    }
    assert next_tokens([regen], 3, "cpu") is None
    assert next_tokens([regen, scored], 3, "cpu").tolist() == [[6, 7, 0], [9, 8, 0]]


def test_training_on_scored_text_learns_greedy_drafting(tmp_path):
    """Text the target did not write (its samples at temperature 0.05, which its near-flat logits
    make differ from its greedy choice at about half the tokens), scored with target_next, trains a
    drafter that drafts greedy continuations well on held-out prompts; the same text with its own
    tokens as labels (no target_next) teaches the sampled text instead and accepts less (measured:
    untrained 1.01, plain labels 3.08, scored 3.72)."""
    V, B = 64, 8
    t = tiny_target("qwen3", vocab_size=V)
    with torch.no_grad():
        for layer in t.layers:
            layer.self_attn.o_proj.weight.mul_(0.3)  # learnable in a few hundred steps (test_train.py)
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, V, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist() for _ in range(560)
    ]
    sampled = generate_baseline(
        t, prompts[:512], SamplingParams(max_new_tokens=64, ignore_eos=True, temperature=0.05, seed=0)
    ).tokens
    texts = [_text(p + o) for p, o in zip(prompts, sampled)]
    scored = score_corpus(t, SpaceTokenizer(), texts, tmp_path / "scored", seq_len=128, progress=False)
    agree = agreement(read_sequences(scored))
    assert 0.2 < agree < 0.9, agree  # the text really is off the greedy path
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "data-00000.jsonl").write_text(
        "".join(json.dumps({"input_ids": s["input_ids"], "prompt_len": 1}) + "\n" for s in read_sequences(scored))
    )
    held, params = prompts[512:], SamplingParams(max_new_tokens=48, ignore_eos=True)
    torch.manual_seed(0)
    tau0 = generate(
        t, DFlashDrafter(DrafterConfig.for_target(t.config, num_layers=1, block_size=B)).bind(t), held, params
    ).stats.tau
    taus = {}
    for name, data in (("scored", scored), ("plain", plain)):
        cfg = TrainConfig(
            data=str(data),
            out=str(tmp_path / f"out-{name}"),
            num_layers=1,
            block_size=B,
            batch_size=8,
            epochs=6,
            lr=3e-3,
            anchors_per_seq=16,
        )
        d = DFlashDrafter.from_pretrained(train(cfg, target=t, progress=False), target=t)
        res = generate(t, d, held, params)
        assert res.tokens == generate_baseline(t, held, params).tokens
        taus[name] = res.stats.tau
    assert taus["scored"] >= 2.5 * tau0 and taus["scored"] > taus["plain"], (tau0, taus)


def test_training_mixes_regenerated_and_scored_folders(tmp_path):
    t = tiny_target("qwen3")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (5,), generator=g).tolist() for _ in range(8)]
    outs = generate_baseline(t, prompts, SamplingParams(max_new_tokens=20, ignore_eos=True)).tokens
    regen = tmp_path / "regen"
    regen.mkdir()
    (regen / "data-00000.jsonl").write_text(
        "".join(json.dumps({"input_ids": p + o, "prompt_len": 5}) + "\n" for p, o in zip(prompts, outs))
    )
    scored = score_corpus(
        t,
        SpaceTokenizer(),
        [_text(torch.randint(0, 256, (256,), generator=g).tolist())],
        tmp_path / "scored",
        seq_len=64,
        progress=False,
    )
    cfg = TrainConfig(
        data=f"{regen},{scored}",
        out=str(tmp_path / "o"),
        block_size=4,
        batch_size=4,
        epochs=1,
        anchors_per_seq=4,
        draft_vocab=32,
    )
    train(cfg, target=t, progress=False)
    state = torch.load(tmp_path / "o" / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 3  # 8 + 4 sequences, 4 per batch


def test_data_score_cli(tmp_path):
    from click.testing import CliRunner
    from conftest import tiny_model_dir

    from dflash_trt.cli import main

    model = tiny_model_dir(tmp_path / "model")
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text("def add(a, b):\n    return a + b\n" * 40)
    (src / "notes.bin").write_text("ignored: not a text suffix")
    r = CliRunner().invoke(
        main,
        [
            "data",
            "score",
            "--target",
            str(model),
            "--text",
            str(src),
            "--out",
            str(tmp_path / "out"),
            "--seq-len",
            "64",
        ],
    )
    assert r.exit_code == 0, r.output
    seqs = read_sequences(tmp_path / "out")
    assert seqs and all(len(s["target_next"]) == len(s["input_ids"]) for s in seqs)
    assert "agrees with the target's greedy prediction at" in r.output
    r = CliRunner().invoke(
        main, ["data", "score", "--target", str(model), "--text", str(tmp_path / "nope"), "--out", str(tmp_path / "o2")]
    )
    assert r.exit_code == 2 and "not a file or folder and not a built-in source" in r.output
    assert not (tmp_path / "o2").exists()
