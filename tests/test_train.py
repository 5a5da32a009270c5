"""Training end to end on a tiny target: learning, kill-and-resume determinism, bad input."""

import json

import pytest
import torch
from conftest import tiny_hf, tiny_target
from train_common import corpus, drafter_weights, write_corpus

from dflash_trt.config import DrafterConfig, SamplingParams
from dflash_trt.decoding.loop import generate, generate_baseline
from dflash_trt.errors import ConfigError, DFlashError
from dflash_trt.modeling.drafter import DFlashDrafter
from dflash_trt.train.data import read_sequences
from dflash_trt.train.prompts import load_prompts
from dflash_trt.train.trainer import TrainConfig, train


def test_kill_and_resume_reaches_same_weights(tmp_path):
    t = tiny_target("qwen3")
    data = write_corpus(tmp_path / "data", *corpus(t, 24, 0, 256, max_new=24))
    base = dict(data=str(data), block_size=4, batch_size=4, epochs=2, bf16=False, anchors_per_seq=4, save_every=2)
    straight = train(TrainConfig(out=str(tmp_path / "a"), **base), target=t, progress=False)
    train(TrainConfig(out=str(tmp_path / "b"), max_steps=5, **base), target=t, progress=False)  # "killed" at 5
    resumed = train(TrainConfig(out=str(tmp_path / "b"), **base), target=t, progress=False)
    wa, wb = drafter_weights(straight), drafter_weights(resumed)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    state = torch.load(tmp_path / "b" / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 12  # 24 sequences / 4 per batch * 2 epochs
    assert not any(p.name.startswith(".ckpt") for p in (tmp_path / "b").iterdir())  # no half-written checkpoint


def test_resume_refuses_another_shape_and_flags_changed_data(tmp_path, capsys):
    t = tiny_target("qwen3")
    prompts, outs = corpus(t, 8, 0, 256, max_new=20)
    data = write_corpus(tmp_path / "data", prompts, outs)
    base = dict(
        data=str(data), batch_size=4, epochs=2, bf16=False, anchors_per_seq=4, save_every=1, out=str(tmp_path / "o")
    )
    train(TrainConfig(block_size=4, max_steps=1, **base), target=t, progress=False)
    with pytest.raises(ConfigError, match="block_size: checkpoint 4 vs now 6.*new --out"):
        train(TrainConfig(block_size=6, **base), target=t, progress=False)
    capsys.readouterr()
    write_corpus(tmp_path / "data", prompts[:6], outs[:6])  # the data changed under the checkpoint
    train(TrainConfig(block_size=4, **base), target=t, progress=False)
    assert "data (or seed / batch size) changed since this checkpoint" in capsys.readouterr().out
    state = torch.load(tmp_path / "o" / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 4  # continued on the 6-sequence data: 2 batches x 2 epochs


def test_validation_metrics_logged_and_improving(tmp_path):
    from dflash_trt.train.data import mark_validation
    from dflash_trt.train.validate import fixed_anchors

    assert fixed_anchors(20, 5, 4, 3) == [5, 11, 16] and fixed_anchors(20, 5, 4, 100) == list(range(5, 17))
    assert fixed_anchors(8, 5, 4, 3) == []  # no room for a block
    V = 64
    t = tiny_target("qwen3", vocab_size=V)
    with torch.no_grad():
        for layer in t.layers:
            layer.self_attn.o_proj.weight.mul_(0.3)  # learnable in few steps (see the threefold test)
    prompts, outs = corpus(t, 136, 0, V, max_new=40)
    data = write_corpus(tmp_path / "data", prompts[:128], outs[:128])
    val = write_corpus(tmp_path / "val", prompts[128:], outs[128:])
    mark_validation(val, "test")
    cfg = TrainConfig(
        data=str(data),
        val_data=str(val),
        out=str(tmp_path / "o"),
        num_layers=1,
        block_size=4,
        batch_size=8,
        epochs=4,
        lr=3e-3,
        anchors_per_seq=8,
        save_every=16,
        log_every=4,
    )
    train(cfg, target=t, progress=False)
    rows = [json.loads(ln) for ln in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()]
    vals = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in vals] == [16, 32, 48, 64] and all(len(r["val_acc"]) == 3 for r in vals)
    assert len([r for r in rows if "loss" in r]) == 16
    assert vals[-1]["val_loss"] < vals[0]["val_loss"] and vals[-1]["val_tau_est"] > vals[0]["val_tau_est"]
    assert vals[-1]["val_blocks"] == 8 * 32  # 8 sequences, 37 admissible anchors each, 32 used
    with pytest.raises(ConfigError, match="validation set"):
        train(TrainConfig(data=str(val), out=str(tmp_path / "o2")), target=t, progress=False)


@pytest.mark.parametrize("kd_weight", [0.0, 0.5])
def test_offline_features_equal_online(tmp_path, kd_weight):
    t = tiny_target("llama")
    data = write_corpus(tmp_path / "data", *corpus(t, 8, 1, 256, max_new=20))
    base = dict(
        data=str(data), block_size=4, batch_size=4, epochs=1, bf16=False, anchors_per_seq=4, kd_weight=kd_weight
    )
    on = train(TrainConfig(out=str(tmp_path / "on"), **base), target=t, progress=False)
    off = train(TrainConfig(out=str(tmp_path / "off"), features="offline", **base), target=t, progress=False)
    won, woff = drafter_weights(on), drafter_weights(off)
    # offline features are stored in bf16, so equality is up to that rounding, relative to each tensor's
    # size (fc's saved weight is the trained one divided by the taps' RMS, ~0.03 on this tiny target)
    assert all(torch.allclose(won[k], woff[k], atol=2e-2 * max(1.0, won[k].abs().max().item())) for k in won)
    assert (tmp_path / "off" / "features" / "complete").is_file()
    taps = len(DrafterConfig.for_target(t.config, block_size=4).target_layer_ids) + (
        kd_weight > 0
    )  # + the teacher layer
    rows = sum(len(s["input_ids"]) for s in read_sequences(data))
    assert (tmp_path / "off" / "features" / "features.bin").stat().st_size == rows * taps * t.config.hidden_size * 2


@pytest.mark.parametrize("kd_weight", [0.0, 1.0])
def test_training_improves_tau_threefold(tmp_path, kd_weight):
    """A drafter trained on the target's own greedy outputs accepts far more than an untrained one,
    on held-out prompts. The tiny random target has its attention outputs scaled by 0.3 so that its
    continuations depend mostly on recent tokens: a distribution a 1-layer drafter can learn in a
    few hundred CPU steps (a fully random 2-layer target needs far more). kd_weight=1 trains on the
    target's distributions alone (soft labels): a teacher read one position off would not learn."""
    V, B = 64, 8
    t = tiny_target("qwen3", vocab_size=V)
    with torch.no_grad():
        for layer in t.layers:
            layer.self_attn.o_proj.weight.mul_(0.3)
    prompts, outs = corpus(t, 560, 0, V, max_new=64)
    data = write_corpus(tmp_path / "data", prompts[:512], outs[:512])
    held = prompts[512:]
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    torch.manual_seed(0)
    untrained = DFlashDrafter(DrafterConfig.for_target(t.config, num_layers=1, block_size=B)).bind(t)
    tau0 = generate(t, untrained, held, params).stats.tau
    cfg = TrainConfig(
        data=str(data),
        out=str(tmp_path / "out"),
        num_layers=1,
        block_size=B,
        batch_size=8,
        epochs=6,
        lr=3e-3,
        bf16=False,
        anchors_per_seq=16,
        kd_weight=kd_weight,
    )
    trained = DFlashDrafter.from_pretrained(train(cfg, target=t, progress=False), target=t)
    res = generate(t, trained, held, params)
    assert res.tokens == generate_baseline(t, held, params).tokens  # still lossless
    assert res.stats.tau >= 3 * tau0, (tau0, res.stats.tau)


def test_bad_inputs_have_clear_errors(tmp_path):
    t = tiny_target("qwen3")
    with pytest.raises(DFlashError, match="no data-\\*.jsonl"):
        read_sequences(tmp_path)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "data-00000.jsonl").write_text('{"input_ids": [1, 2]}\n')
    with pytest.raises(DFlashError, match="data-00000.jsonl:1: malformed"):
        read_sequences(tmp_path / "bad")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "data-00000.jsonl").write_text("\n")
    with pytest.raises(DFlashError, match="empty"):
        read_sequences(tmp_path / "empty")
    with pytest.raises(DFlashError, match="not a file and not a built-in source"):
        load_prompts(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ConfigError, match="block_size=64 must be smaller than max_seq_len=32"):
        TrainConfig(block_size=64, max_seq_len=32)
    with pytest.raises(ConfigError, match=r"kd_weight=1.5: must be in \[0, 1\]"):
        TrainConfig(kd_weight=1.5)
    data = write_corpus(tmp_path / "short", [[1, 2]], [[3, 4, 5]])
    with pytest.raises(ConfigError, match="block_size=4"):
        train(TrainConfig(data=str(data), out=str(tmp_path / "o"), block_size=4, bf16=False), target=t, progress=False)
    data = write_corpus(tmp_path / "ok", *corpus(t, 4, 0, 256, max_new=12))
    with pytest.raises(ConfigError, match="target_layer_ids"):
        train(
            TrainConfig(data=str(data), out=str(tmp_path / "o2"), block_size=4, target_layer_ids=[0, 7]),
            target=t,
            progress=False,
        )


def test_train_cli_with_yaml(tmp_path):
    from click.testing import CliRunner

    from dflash_trt.cli import main

    hf = tiny_hf("qwen3")
    hf.save_pretrained(tmp_path / "target")
    t = tiny_target("qwen3")
    data = write_corpus(tmp_path / "data", *corpus(t, 8, 0, 256, max_new=16))
    (tmp_path / "train.yaml").write_text(
        f"target: {tmp_path / 'target'}\ndata: {data}\nblock_size: 4\n" f"batch_size: 4\nbf16: false\n"
    )
    r = CliRunner().invoke(
        main,
        ["train", "--config", str(tmp_path / "train.yaml"), "--out", str(tmp_path / "o"), "--anchors-per-seq", "2"],
    )
    assert r.exit_code == 0, r.output
    d = DFlashDrafter.from_pretrained(tmp_path / "o" / "drafter")
    assert d.config.block_size == 4
    (tmp_path / "bad.yaml").write_text("blok_size: 4\n")
    r = CliRunner().invoke(main, ["train", "--config", str(tmp_path / "bad.yaml")])
    assert r.exit_code == 2 and "unknown field(s) blok_size" in r.output


def test_benchmark_prompts_refused_as_training_data(tmp_path):
    from click.testing import CliRunner

    from dflash_trt.cli import main

    r = CliRunner().invoke(
        main, ["data", "generate", "--target", "x", "--prompts", "humaneval", "--out", str(tmp_path)]
    )
    assert r.exit_code == 2 and "held out from training" in r.output
    assert not any(tmp_path.iterdir())


def test_train_cli_help_comes_from_field_comments():
    from click.testing import CliRunner

    from dflash_trt.cli import main

    out = CliRunner().invoke(main, ["train", "--help"], terminal_width=200).output
    assert "blocks trained per sequence, resampled each epoch" in out and "--draft-vocab" in out


def test_draft_vocab_training_saves_vocab(tmp_path):
    t = tiny_target("qwen3")
    data = write_corpus(tmp_path / "d", *corpus(t, 8, 0, 256, max_new=16))
    out = train(
        TrainConfig(data=str(data), out=str(tmp_path / "o"), block_size=4, draft_vocab=20, max_steps=3, batch_size=4),
        target=t,
        progress=False,
    )
    d = DFlashDrafter.from_pretrained(out)
    seqs = read_sequences(data)
    assert d.config.draft_vocab_size == len(d.draft_vocab) <= 20
    assert set(d.draft_vocab.tolist()) <= {x for s in seqs for x in s["input_ids"][s["prompt_len"] :]}


def test_tap_scaling_trains_on_scaled_taps_and_saves_a_plain_fc(tmp_path):
    """fc is trained on taps / per-dim RMS, but every state_dict (checkpoint, final drafter) holds the
    folded raw-space weight: the saved drafter is a plain z-lab drafter taking raw target states."""
    from dflash_trt.train.precondition import FLOOR, ScaledFC, tap_scale, use_tap_scaling

    # position 0 (attention sink) is left out of the scale; tiny dims are floored, not amplified
    a = torch.tensor([[1000.0, 0.0, 1.0], [3.0, 1e-9, 2.0], [4.0, 1e-9, 2.0]])
    s = tap_scale([a, torch.tensor([[5.0, 5.0, 5.0]])])  # a one-token sequence adds nothing
    assert torch.allclose(s[[0, 2]], torch.tensor([12.5**0.5, 2.0]))
    assert s[1].item() == pytest.approx(FLOOR * 2.0)
    t = tiny_target("qwen3")
    cfg = DrafterConfig.for_target(t.config, num_layers=1, block_size=4)
    d = DFlashDrafter(cfg).bind(t, cast=False)
    plain = {k: v.clone() for k, v in d.state_dict().items()}
    taps = torch.randn(2, 5, cfg.num_taps * cfg.hidden_size) * torch.linspace(0.1, 50, cfg.num_taps * cfg.hidden_size)
    ref = d.fuse(taps)
    scale = torch.rand(cfg.num_taps * cfg.hidden_size) + 0.5
    fc = use_tap_scaling(d, scale)
    assert isinstance(d.fc, ScaledFC) and torch.equal(fc.weight, plain["fc.weight"])  # default init, scaled space
    with torch.no_grad():
        fc.weight.mul_(2.0)
    sd = d.state_dict()
    assert set(sd) == set(plain)  # no extra tensors: the z-lab layout
    assert torch.allclose(sd["fc.weight"], 2.0 * plain["fc.weight"] / scale)
    d.save_pretrained(tmp_path / "d")
    back = DFlashDrafter.from_pretrained(tmp_path / "d", target=t)
    assert type(back.fc) is torch.nn.Linear
    assert torch.allclose(back.fuse(taps), d.fuse(taps), atol=1e-5)
    assert not torch.allclose(back.fuse(taps), ref, atol=1e-3)
    d2 = DFlashDrafter(cfg)
    use_tap_scaling(d2, scale)
    d2.load_state_dict(sd)  # unfolds: W' = W * scale
    assert torch.allclose(d2.fc.weight, fc.weight, atol=1e-6)

    # in training: the checkpoint keeps the exact trained parameter and the scale; switching the
    # setting on resume is refused with the field named
    data = write_corpus(tmp_path / "data", *corpus(t, 8, 0, 256, max_new=20))
    base = dict(
        data=str(data), block_size=4, batch_size=4, epochs=2, anchors_per_seq=4, save_every=1, out=str(tmp_path / "o")
    )
    out = train(TrainConfig(max_steps=2, **base), target=t, progress=False)
    state = torch.load(tmp_path / "o" / "checkpoint" / "trainer_state.pt", weights_only=False)
    saved = DFlashDrafter.from_pretrained(out).state_dict()["fc.weight"]
    assert torch.allclose(saved, state["fc_weight"] / state["tap_scale"])
    with pytest.raises(ConfigError, match="tap_scaling=False: the checkpoint .* tap_scaling=True"):
        train(TrainConfig(tap_scaling=False, **base), target=t, progress=False)


def test_eval_cli_sweeps_block_sizes_and_refuses_larger_than_trained(tmp_path, monkeypatch):
    from click.testing import CliRunner
    from conftest import tiny_drafter, tiny_model_dir

    from dflash_trt.api import encode, load_tokenizer
    from dflash_trt.cli import main
    from dflash_trt.modeling.target import TargetModel

    tdir = tiny_model_dir(tmp_path / "t")
    t = TargetModel.from_pretrained(tdir, dtype=torch.float32)
    tiny_drafter(t, block_size=6, num_layers=1, scale=3.0).save_pretrained(tmp_path / "d")
    prompts = ["def add(a, b):", "The quick brown fox"]
    (tmp_path / "p.txt").write_text("\n".join(prompts) + "\n")
    args = [
        "eval",
        "--target",
        str(tdir),
        "--drafter",
        str(tmp_path / "d"),
        "--prompts",
        str(tmp_path / "p.txt"),
        "--max-new-tokens",
        "12",
        "--no-chat",
    ]
    r = CliRunner().invoke(main, args + ["--block-size", "2,6", "--json-out", str(tmp_path / "e.json")])
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "e.json").read_text())
    assert [row["block_size"] for row in res["sweep"]] == [2, 6] and res["trained_block_size"] == 6
    assert res["block_size"] == 2 and res["tau"] == res["sweep"][0]["tau"]
    assert [len(row["per_position_acceptance"]) for row in res["sweep"]] == [1, 5]
    assert 1.0 <= res["sweep"][0]["tau"] <= 2.0 and "block 6" in r.output
    # the block-6 row is what plain generation at the drafter's own block size measures
    d = DFlashDrafter.from_pretrained(tmp_path / "d", target=t).eval()
    tok = load_tokenizer(tdir)
    params = SamplingParams(max_new_tokens=12, stop_token_ids=[tok.eos_token_id])
    accepted = sum(generate(t, d, [encode(tok, p, False)], params).stats.num_accepted_draft_tokens for p in prompts)
    steps = sum(generate(t, d, [encode(tok, p, False)], params).stats.num_verify_steps for p in prompts)
    assert res["sweep"][1]["tau"] == pytest.approx(1 + accepted / steps)
    r = CliRunner().invoke(main, args + ["--block-size", "8"])
    assert r.exit_code != 0 and "choose 2..6" in r.output
    # block sizes x draft cutoffs; an untrained drafter is never 0.9 sure: those rows verify no draft
    r = CliRunner().invoke(
        main, args + ["--block-size", "2,6", "--draft-cutoff", "0,0.9", "--json-out", str(tmp_path / "c.json")]
    )
    assert r.exit_code == 0, r.output
    rows = json.loads((tmp_path / "c.json").read_text())["sweep"]
    assert [(x["block_size"], x["draft_cutoff"]) for x in rows] == [(2, 0.0), (2, 0.9), (6, 0.0), (6, 0.9)]
    assert [x["verified_drafts_per_step"] for x in rows] == [1.0, 0.0, 5.0, 0.0]
    r = CliRunner().invoke(main, args + ["--draft-cutoff", "1.5"])
    assert r.exit_code == 2 and "--draft-cutoff 1.5" in r.output
    # timed on a busy machine: the JSON says how busy and the table is followed by a warning
    assert 0.0 <= res["other_cpu_share"] <= 1.0
    from dflash_trt import contention

    snaps = iter([(0.0, 0.0, 0.0), (1e6, 0.0, 1.0)])  # others used every CPU the whole time
    monkeypatch.setattr(contention, "_snapshot", lambda: next(snaps))
    r = CliRunner().invoke(main, args + ["--json-out", str(tmp_path / "busy.json")])
    assert r.exit_code == 0 and "other processes used 100%" in r.output and "not reliable" in r.output
    assert json.loads((tmp_path / "busy.json").read_text())["other_cpu_share"] == 1.0
    r = CliRunner().invoke(main, args + ["--block-size", "4,x"])
    assert r.exit_code == 2 and "--block-size" in r.output
    # a DFlash output that differs from the baseline: a bug in fp32, a counted rounding effect in bf16
    import dflash_trt.train.evaluate as evaluate_mod  # where the eval command looks `generate` up

    monkeypatch.undo()  # the busy-machine snapshots above
    real = evaluate_mod.generate

    def off_by_one(*a, **k):
        res = real(*a, **k)
        res.tokens[0][-1] += 1
        return res

    monkeypatch.setattr(evaluate_mod, "generate", off_by_one)
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2 and "this is a bug" in r.output
    r = CliRunner().invoke(main, args + ["--dtype", "bfloat16", "--json-out", str(tmp_path / "bf.json")])
    said = " ".join(r.output.split())  # rich wraps lines
    assert (
        r.exit_code == 0
        and "2 DFlash run(s) differ" in said
        and "in bfloat16, a verify block rounds differently" in said
        and "--dtype float32 checks exactness" in said
    ), said
    bf = json.loads((tmp_path / "bf.json").read_text())
    assert bf["mismatches"] == 2 and bf["dtype"] == "bfloat16" and res["mismatches"] == 0


def test_soft_label_features_serve_a_hard_label_run(tmp_path):
    """A hard-label run pointed at a soft-label run's features reuses them (no recompute) and trains
    exactly as on its own taps-only features."""
    t = tiny_target("qwen3")
    data = write_corpus(tmp_path / "data", *corpus(t, 8, 2, 256, max_new=20))
    base = dict(data=str(data), block_size=4, batch_size=4, epochs=1, bf16=False, anchors_per_seq=4, features="offline")
    train(TrainConfig(out=str(tmp_path / "kd"), kd_weight=0.5, **base), target=t, progress=False)
    shared = tmp_path / "kd" / "features" / "features.bin"
    stamp = shared.stat().st_mtime_ns
    reused = train(
        TrainConfig(out=str(tmp_path / "a"), features_dir=str(shared.parent), **base), target=t, progress=False
    )
    own = train(TrainConfig(out=str(tmp_path / "b"), **base), target=t, progress=False)
    assert shared.stat().st_mtime_ns == stamp
    assert (tmp_path / "b" / "features" / "features.bin").stat().st_size < shared.stat().st_size
    wa, wb = drafter_weights(reused), drafter_weights(own)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
