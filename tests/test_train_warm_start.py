"""Training a drafter family from the CLI config: warm start on a DFlash backbone, a frozen
backbone, Domino from the command line, D-PACE weights by hand and end to end."""

import json
import math

import pytest
import torch
from conftest import tiny_hf, tiny_target
from train_common import corpus, drafter_weights, write_corpus

from dflash_trt.config import DrafterConfig
from dflash_trt.errors import ConfigError
from dflash_trt.modeling.drafter import DFlashDrafter
from dflash_trt.train.trainer import TrainConfig, train

# ---- drafter families, warm start, D-PACE (train --family / --init-from / --loss) -----------------


def test_dpace_weights_and_loss_by_hand():
    from dflash_trt.train.objective import dpace_loss, dpace_weights, drafter_train_forward, make_blocks

    p = torch.tensor([[0.5, 0.2, 0.8]])
    # smooth = 0.5 p + 0.5 = [0.75, 0.6, 0.9]; prefix = [0.75, 0.45, 0.405]; reverse cumsum
    torch.testing.assert_close(
        dpace_weights(p, torch.ones(1, 3, dtype=torch.bool), 0.5), torch.tensor([[1.605, 0.855, 0.405]])
    )
    # a masked-out position: 1 in the product, nothing in the sums
    torch.testing.assert_close(
        dpace_weights(p, torch.tensor([[True, True, False]]), 0.5), torch.tensor([[1.2, 0.45, 0.0]])
    )
    torch.testing.assert_close(
        dpace_weights(p, torch.ones(1, 3, dtype=torch.bool), 1.0), torch.tensor([[3.0, 2.0, 1.0]])
    )
    t = tiny_target("qwen3")
    cfg = DrafterConfig.for_target(t.config, num_layers=1, block_size=4)
    torch.manual_seed(0)
    d = DFlashDrafter(cfg).float().bind(t, cast=False)
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    taps = t.forward(ids, t.new_cache(2, 16), tap_layers=d.target_layer_ids).taps
    blocks = make_blocks(
        ids, torch.tensor([[3, 8], [5, 0]]), torch.tensor([[True, True], [True, False]]), 4, d.mask_token_id
    )
    got = dpace_loss(d, taps, blocks, 7.0, alpha=0.25).loss.item()
    logits = d.finish_logits(d.head_logits(drafter_train_forward(d, taps, blocks)[:, :, 1:]))
    total = 0.0
    for r, j in [(0, 0), (0, 1), (1, 0)]:
        q = [logits[r, j, k].softmax(-1)[blocks.labels[r, j, k]].item() for k in range(3)]
        prefix = [0.0] * 3
        acc = 1.0
        for k in range(3):
            acc *= 0.75 * q[k] + 0.25
            prefix[k] = acc
        total += sum(-math.log(q[k]) * sum(prefix[k:]) for k in range(3))
    assert math.isclose(got, total / 2, rel_tol=1e-5)  # divided by the batch (2 sequences)


def test_train_config_family_errors_are_one_line(monkeypatch):
    cases = [
        (dict(family="eagle"), r"^family='eagle': choose one of dflash, dflash2, dspark, domino$"),
        (
            dict(family="domino", family_fields={"markov_rank": 8, "emb_dim": 8, "gru_hidden_dim": 8}),
            r"^family_fields.markov_rank: a DSpark field \(family: dspark\), not a Domino one",
        ),
        (dict(family_fields={"markov_rank": 8}), r"^family_fields.markov_rank: a DSpark field .*not a DFlash one"),
        (dict(family="domino"), r"^family_fields: a Domino drafter needs emb_dim, gru_hidden_dim$"),
        (dict(family="dspark", loss="dpace"), r"^loss=dpace: weights plain DFlash's CE"),
        (dict(loss="ce"), r"^loss='ce': choose 'dflash' or 'dpace'$"),
        (dict(family="dspark", freeze_backbone=True), r"^freeze_backbone: needs init_from"),
        (dict(family="dspark", draft_vocab=100), r"^draft_vocab=100: leave 0 \(family=dspark trains on the full"),
    ]
    for kw, pattern in cases:
        with pytest.raises(ConfigError, match=pattern) as e:
            TrainConfig(**kw)
        assert "\n" not in str(e.value)


def test_dspark_warm_start_with_frozen_backbone_and_domino_from_cli(tmp_path, capsys):
    from click.testing import CliRunner

    from dflash_trt.cli import main

    t = tiny_target("qwen3")
    data = write_corpus(tmp_path / "data", *corpus(t, 8, 0, 256, max_new=16))
    base = dict(data=str(data), block_size=4, batch_size=4, bf16=False, anchors_per_seq=4, save_every=1)
    backbone = train(TrainConfig(out=str(tmp_path / "bb"), epochs=2, **base), target=t, progress=False)
    fields = {"markov_rank": 16, "confidence_head_alpha": 1.0, "sample_from_anchor": False}  # a DFlash backbone
    cfg = dict(base, family="dspark", family_fields=fields, init_from=str(backbone), freeze_backbone=True)
    train(TrainConfig(out=str(tmp_path / "ds"), max_steps=1, **cfg), target=t, progress=False)
    out = train(TrainConfig(out=str(tmp_path / "ds"), epochs=2, **cfg), target=t, progress=False)  # resumed
    assert "L1 + confidence terms against the target's logits" in capsys.readouterr().out
    d = DFlashDrafter.from_pretrained(out)
    assert d.config.architectures == ["DSparkDraftModel"] and d.config.family_fields["markov_rank"] == 16
    before, after = drafter_weights(backbone), d.state_dict()
    heads = [k for k in after if k not in before]
    assert heads and all(torch.allclose(before[k], after[k], atol=1e-6) for k in before)  # backbone kept
    assert any("confidence" in k for k in heads)
    init = DFlashDrafter(d.config)
    init.load_state_dict(before, strict=False)
    init.family.init_heads(init)
    assert any(not torch.equal(init.state_dict()[k], after[k]) for k in heads)  # the heads trained
    with pytest.raises(ConfigError, match=r"architectures: checkpoint \['DSparkDraftModel'\] vs now"):
        train(TrainConfig(out=str(tmp_path / "ds"), **base), target=t, progress=False)  # another family
    hf = tiny_hf("qwen3")
    hf.save_pretrained(tmp_path / "target")
    args = ["train", "--target", str(tmp_path / "target"), "--data", str(data), "--out", str(tmp_path / "dom")]
    args += ["--block-size", "4", "--batch-size", "4", "--no-bf16", "--anchors-per-seq", "2", "--max-steps", "2"]
    args += ["--family", "domino", "--family-fields", '{"emb_dim": 16, "gru_hidden_dim": 8}']
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert DFlashDrafter.from_pretrained(tmp_path / "dom" / "drafter").config.architectures == ["DominoDraftModel"]
    r = CliRunner().invoke(main, args[:-1] + ['{"markov_rank": 4}'])
    assert r.exit_code == 2 and "family_fields.markov_rank: a DSpark field" in r.output
    r = CliRunner().invoke(main, args[:-1] + ["{emb_dim: 16"])
    assert r.exit_code == 2 and "--family-fields: not JSON" in r.output


def test_dpace_loss_trains_from_the_cli_config(tmp_path):
    t = tiny_target("qwen3")
    data = write_corpus(tmp_path / "data", *corpus(t, 8, 0, 256, max_new=16))
    base = dict(data=str(data), block_size=4, batch_size=4, bf16=False, anchors_per_seq=4, epochs=2)
    a = drafter_weights(train(TrainConfig(out=str(tmp_path / "a"), loss="dpace", **base), target=t, progress=False))
    b = drafter_weights(train(TrainConfig(out=str(tmp_path / "b"), **base), target=t, progress=False))
    assert any(not torch.equal(a[k], b[k]) for k in a)  # another objective, other weights
    rows = [json.loads(ln) for ln in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in rows)
