"""The bench's pieces without a run: BenchConfig and `bench` CLI option validation, and the report's
summary of runs (tau, acceptance, drafts per step, predicted acceptance)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from dflash_trt.bench.methods import METHODS, Run
from dflash_trt.bench.runner import BenchConfig
from dflash_trt.cli import main
from dflash_trt.errors import DFlashError

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


def test_bench_config_validation():
    with pytest.raises(DFlashError, match="unknown"):
        BenchConfig(target="x", methods=["baseline", "nope"])
    r = CliRunner().invoke(main, ["bench", "--target", "x", "--sweep-block-sizes", "4,eight"])
    assert r.exit_code == 2 and "comma-separated integers" in r.output
    with pytest.raises(DFlashError, match="draft_cutoff=1.0"):
        BenchConfig(target="x", draft_cutoff=1.0)
    with pytest.raises(DFlashError, match="proposer='suffix': choose one of dflash, ngram, hybrid"):
        BenchConfig(target="x", proposer="suffix")
    assert {"ngram", "hybrid", "tree"} <= set(METHODS)


def test_bench_draft_length_validation():
    with pytest.raises(DFlashError, match="draft_length=confidence needs draft_cutoff > 0"):
        BenchConfig(target="x", draft_length="confidence")
    with pytest.raises(DFlashError, match="draft_length='nope'"):
        BenchConfig(target="x", draft_length="nope")


def test_summary_of_predicted_acceptance():
    from dflash_trt.bench.report import summarize

    s = summarize(
        [
            Run([1] * 9, 9, 0.5, 1.5, [0, 1, 2, 1], predicted_at=[3.0, 1.0]),
            Run([1] * 5, 5, 0.5, 1.5, [0, 4], predicted_at=[1.0, 0.0]),
        ]
    )
    assert s["predicted_per_position"] == pytest.approx([4 / 8, 1 / 8])
    assert s["predicted_tau"] == pytest.approx(1 + 5 / 8)
    assert summarize([Run([1] * 5, 5, 0.5, 1.5, [0, 4])])["predicted_tau"] is None


def test_summary_of_runs():
    from dflash_trt.bench.report import summarize

    s = summarize([Run([1] * 9, 9, 0.5, 1.5, [0, 1, 2, 1]), Run([1] * 5, 5, 0.5, 1.5, [0, 4])])
    assert s["decode_tokens_per_s"] == pytest.approx(12 / 2.0)
    assert s["tau"] == pytest.approx((1 + 4 + 3 + 4) / 8) and s["decode_steps"] == 8
    assert s["per_position_acceptance"] == pytest.approx([3 / 8, 1 / 8])
    assert s["drafts_per_step"] is None  # no method reported how many drafts were judged
    judged = summarize(
        [
            Run([1] * 9, 9, 0.5, 1.5, [0, 1, 2, 1], drafts_verified=6),
            Run([1] * 5, 5, 0.5, 1.5, [0, 4], drafts_verified=2),
        ]
    )
    assert judged["drafts_per_step"] == pytest.approx(8 / 8)
