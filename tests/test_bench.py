"""`dflash-trt bench` end to end on a tiny random target (real tokenizer) and drafter: the greedy
exactness check (a deliberately wrong method must fail the run), sampling and scaling runs, draft sources
and cutoffs, prompt fitting, and DSpark / Domino drafters."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from click.testing import CliRunner
from conftest import tiny_model_dir

from dflash_trt.bench.methods import HF, METHODS
from dflash_trt.bench.runner import BenchConfig, OutputMismatchError, run_bench
from dflash_trt.bench.schedule import fit_prompt
from dflash_trt.cli import main
from dflash_trt.config import DrafterConfig
from dflash_trt.modeling.drafter import DFlashDrafter

PROMPTS = ["def add(a, b):", "The quick brown fox", "Speculative decoding drafts tokens and verifies them."]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoConfig

    root = tmp_path_factory.mktemp("bench")
    tiny_model_dir(root / "target")
    torch.manual_seed(1)
    cfg = DrafterConfig.for_target(AutoConfig.from_pretrained(root / "target"), num_layers=1, block_size=4)
    DFlashDrafter(cfg).save_pretrained(root / "drafter")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return root


def config(root, out, **kw) -> BenchConfig:
    base = dict(
        target=str(root / "target"),
        drafter=str(root / "drafter"),
        datasets=[str(root / "prompts.jsonl")],
        num_prompts=3,
        max_new_tokens=12,
        out_dir=str(out),
        dtype="float32",
        methods=["baseline", "hf", "hf-assisted", "hf-prompt-lookup", "dflash"],
        assistant=str(root / "target"),
    )
    base.update(kw)
    return BenchConfig(**base)


def test_bench_end_to_end(setup, tmp_path):
    rep = run_bench(config(setup, tmp_path, sweep_block_sizes=[2, 8]), say=lambda m: None, progress=False)
    rows = {r["method"]: r for r in rep["rows"]}
    assert [r["block_size"] for r in rep["sweeps"]["block_size"]["rows"]] == [2, 8]  # greedy: checked exact too
    assert set(rows) == {"baseline", "hf", "hf-assisted", "hf-prompt-lookup", "dflash"}
    assert rep["reference"] == "hf" and rep["mismatches"] == []
    assert all(rows[m]["exact"] == "yes" for m in ("baseline", "hf-assisted", "hf-prompt-lookup", "dflash"))
    assert rows["hf"]["speedup_vs_hf"] == pytest.approx(1.0)
    for r in rows.values():
        assert r["prompts"] == 3 and r["decode_tokens_per_s"] > 0 and r["ttft_ms"] > 0
        hist = r["accept_hist"]  # tau is tokens per decode pass, from the same passes the histogram counts
        emitted = sum(k * h for k, h in enumerate(hist))
        assert r["decode_steps"] == sum(hist) > 0 and r["tau"] == pytest.approx(emitted / sum(hist))
        if r["method"] in ("baseline", "hf", "dflash"):  # HF assisted/lookup: the prefill pass verifies drafts too
            assert emitted >= r["output_tokens"] - r["prompts"]  # every token after a prompt's first came from a pass
    for m in ("baseline", "hf"):  # plain decoding: one token per pass, exactly
        assert rows[m]["accept_hist"] == [0, rows[m]["output_tokens"] - 3] and rows[m]["tau"] == 1.0
    d = rows["dflash"]
    assert 1.0 <= d["tau"] <= 4  # block 4: a pass emits 1..4 tokens
    assert d["drafts_per_step"] == 3.0  # ungated: every pass judges B-1 drafts
    assert len(d["per_position_acceptance"]) == 3 and len(d["accept_hist"]) == 5  # block 4: 1..4 tokens per pass
    assert d["draft_ms_per_step"] > 0 and d["verify_ms_per_step"] > 0 and d["bound"] > 0 and d["bound_reached"] > 0
    # the assistant is the target itself: every draft is accepted, so a pass emits >= 2 tokens
    assert rows["hf-assisted"]["tau"] >= 2.0 and rows["hf-assisted"]["draft_ms_per_step"] > 0
    files = {p.name for p in tmp_path.iterdir()}
    assert {"bench.json", "bench.md", "speedup.png", "acceptance_hist.png", "per_position.png"} <= files
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert len(saved["per_prompt"]) == 15 and saved["environment"]["device"] == "cpu"
    md = (tmp_path / "bench.md").read_text()
    assert "| prompts | dflash |" in md and "vs baseline" in md
    assert saved["other_cpu_share"] is None or 0.0 <= saved["other_cpu_share"] <= 1.0  # None off Linux


def test_busy_machine_is_reported_and_warned(setup, tmp_path, monkeypatch):
    from dflash_trt import contention

    snaps = iter([(0.0, 0.0, 0.0), (1e6, 0.0, 1.0)])  # other processes used every CPU while timing
    monkeypatch.setattr(contention, "_snapshot", lambda: next(snaps))
    said = []
    rep = run_bench(
        config(setup, tmp_path, methods=["baseline", "dflash"], plots=False), say=said.append, progress=False
    )
    assert rep["other_cpu_share"] == 1.0
    assert json.loads((tmp_path / "bench.json").read_text())["other_cpu_share"] == 1.0
    assert any("other processes used 100%" in m and "not reliable" in m for m in said)


class WrongMethod(HF):
    """hf with its second-to-last token changed on the second prompt: a lossy method in disguise."""

    name = "wrong"

    def run(self, item, params):
        run = super().run(item, params)
        if item.id == "1":
            run.tokens = run.tokens[:-2] + [(run.tokens[-2] + 1) % 256] + run.tokens[-1:]
        return run


def test_mismatch_fails_the_run_loudly(setup, tmp_path, monkeypatch):
    monkeypatch.setitem(METHODS, "wrong", WrongMethod)
    r = CliRunner().invoke(
        main,
        [
            "bench",
            "--target",
            setup / "target",
            "--drafter",
            setup / "drafter",
            "--dataset",
            setup / "prompts.jsonl",
            "--max-new-tokens",
            "12",
            "--dtype",
            "float32",
            "--methods",
            "hf,wrong,dflash",
            "--out",
            tmp_path,
            "--no-plots",
            "--quiet",
        ],
    )
    assert r.exit_code == 2, r.output
    assert "wrong differs from the reference on prompts/1 at output token 10" in r.output
    rep = json.loads((tmp_path / "bench.json").read_text())
    rows = {x["method"]: x for x in rep["rows"]}
    assert rows["wrong"]["exact"] == "NO" and rows["dflash"]["exact"] == "yes" and len(rep["mismatches"]) == 1
    with pytest.raises(OutputMismatchError, match="prompts/1") as e:
        run_bench(config(setup, tmp_path / "lib", methods=["hf", "wrong"]), say=lambda m: None, progress=False)
    assert "near-ties" not in str(e.value)  # fp32: no excuse
    with pytest.raises(
        OutputMismatchError, match=r"; in bfloat16, a verify block rounds .*--dtype float32 checks exactness"
    ):
        run_bench(
            config(setup, tmp_path / "bf", methods=["hf", "wrong"], dtype="bfloat16"),
            say=lambda m: None,
            progress=False,
        )


def test_sampling_compares_distributions_and_scaling_sweeps(setup, tmp_path):
    rep = run_bench(
        config(
            setup,
            tmp_path,
            methods=["baseline", "hf", "dflash"],
            temperature=1.0,
            max_new_tokens=8,
            sweep_block_sizes=[2, 4],
            sweep_prompt_lengths=[32, 64, 4096],
        ),
        say=lambda m: None,
        progress=False,
    )
    assert rep["mismatches"] == [] and all(r["exact"] in (None, "reference") for r in rep["rows"])
    s = rep["sampling"]
    assert set(s) == {"baseline", "hf", "dflash"} and all(v["mean_logprob"] < 0 for v in s.values())
    assert s["hf"]["js_divergence_vs_reference"] == 0.0 and s["hf"]["z_vs_reference"] == 0.0
    blocks = rep["sweeps"]["block_size"]["rows"]
    assert [r["block_size"] for r in blocks] == [2, 4] and all(r["speedup_vs_baseline"] > 0 for r in blocks)
    lengths = rep["sweeps"]["prompt_length"]
    assert [r["target_length"] for r in lengths["rows"]] == [32, 64]
    assert all(abs(r["mean_prompt_tokens"] - r["target_length"]) <= 3 for r in lengths["rows"])
    assert "4096" in lengths["skipped"]  # beyond the tiny target's 512-token context
    assert {"scaling_block_size.png", "scaling_prompt_length.png"} <= {p.name for p in tmp_path.iterdir()}


def test_unavailable_methods_are_skipped_with_reason(setup, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tritonclient.grpc", None)  # serving not installed
    rep = run_bench(
        config(
            setup,
            tmp_path,
            methods=["hf", "hf-assisted", "dflash-triton"],
            assistant=None,
            num_prompts=1,
            max_new_tokens=4,
            plots=False,
        ),
        say=lambda m: None,
        progress=False,
    )
    assert [r["method"] for r in rep["rows"]] == ["hf"]
    assert "--assistant" in rep["skipped"]["hf-assisted"] and "serving" in rep["skipped"]["dflash-triton"]


def test_fit_prompt_cuts_and_pads_to_length(setup):
    from dflash_trt.api import load_tokenizer

    tok = load_tokenizer(setup / "target")
    for chat in (True, False):
        text, ids = fit_prompt(tok, "The quick brown fox " * 30, chat, 40)
        assert abs(len(ids) - 40) <= 2
        text, ids = fit_prompt(tok, "def add(a, b):", chat, 60, filler="The lazy dog. ")
        assert abs(len(ids) - 60) <= 2 and text.endswith("def add(a, b):")


def test_bench_ngram_and_hybrid_are_exact_and_report_sources(setup, tmp_path):
    """One interleaved run of dflash, ngram, hybrid, hf and hf-prompt-lookup on the built-in `varied` set:
    every method exact, and ours report steps / drafts / accepted per draft source (table and JSON)."""
    rep = run_bench(
        config(
            setup,
            tmp_path,
            datasets=["varied"],
            num_prompts=6,
            max_new_tokens=24,
            max_prompt_tokens=160,  # the tiny target's context is 512
            methods=["hf", "dflash", "ngram", "hybrid", "hf-prompt-lookup"],
            plots=False,
        ),
        say=lambda m: None,
        progress=False,
    )
    rows = {r["method"]: r for r in rep["rows"]}
    assert rep["mismatches"] == [] and all(rows[m]["exact"] == "yes" for m in ("dflash", "ngram", "hybrid"))
    assert rows["hf"]["sources"] is None and rows["hf-prompt-lookup"]["sources"] is None
    for m in ("dflash", "ngram", "hybrid"):
        src = rows[m]["sources"]
        assert set(src) == {"drafter", "copied"}
        assert src["drafter"]["steps"] + src["copied"]["steps"] == rows[m]["decode_steps"]
    assert rows["dflash"]["sources"]["copied"] == {"steps": 0, "drafts": 0, "accepted": 0}
    assert rows["ngram"]["sources"]["drafter"]["drafts"] == 0  # the drafter never runs
    assert rows["ngram"]["sources"]["copied"]["steps"] > 0  # the tiny target repeats itself
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert {r["dataset"] for r in saved["rows"]} == {"varied"}
    ours = [p for p in saved["per_prompt"] if p["method"] in ("dflash", "ngram", "hybrid")]
    assert len(ours) == 18 and all(set(p["sources"]) == {"drafter", "copied"} for p in ours)
    assert all("sources" not in p for p in saved["per_prompt"] if p["method"].startswith("hf"))
    md = (tmp_path / "bench.md").read_text()
    assert "copied acc/drafts" in md and "drafter acc/drafts" in md
    c = rows["ngram"]["sources"]["copied"]
    assert f"| {c['accepted']}/{c['drafts']} |" in md


def test_bench_draft_cutoff_is_used_and_recorded(setup, tmp_path):
    """An untrained drafter is never sure at cutoff 0.5: every dflash step verifies the last token alone
    (one token per pass), outputs stay exact, and the report says which cutoff ran."""
    rep = run_bench(
        config(setup, tmp_path, methods=["baseline", "hf", "dflash"], draft_cutoff=0.5, plots=False),
        say=lambda m: None,
        progress=False,
    )
    d = {r["method"]: r for r in rep["rows"]}["dflash"]
    assert rep["mismatches"] == [] and d["exact"] == "yes"
    assert d["tau"] == 1.0 and d["accept_hist"][2:] == [0, 0, 0] and d["drafts_per_step"] == 0.0
    assert "draft cutoff 0.5" in (tmp_path / "bench.md").read_text()


def _family_drafter(root, name, arch, fields):
    """A tiny drafter of another family (DSpark / Domino: PyTorch path only) for the bench's target."""
    import dataclasses

    from transformers import AutoConfig

    from dflash_trt.families import for_architectures
    from dflash_trt.modeling.target import TargetModel

    if not (root / name / "config.json").is_file():
        target = TargetModel.from_pretrained(root / "target", dtype=torch.float32)
        cfg = DrafterConfig.for_target(AutoConfig.from_pretrained(root / "target"), num_layers=1, block_size=4)
        defaults = for_architectures([arch]).DEFAULTS  # replace() skips the loader that fills them
        cfg = dataclasses.replace(cfg, architectures=[arch], family_fields={**defaults, **fields})
        torch.manual_seed(2)
        DFlashDrafter(cfg).bind(target).save_pretrained(root / name)
    return root / name


DSPARK = {"markov_rank": 8, "markov_head_type": "rnn", "enable_confidence_head": True}


def test_bench_dspark_confidence_reports_predicted_acceptance(setup, tmp_path):
    """A DSpark drafter with a confidence head, draft_length=confidence: kernels auto routes it to PyTorch,
    outputs stay exact, and the report puts the head's predicted per-position acceptance and tau beside
    the measured ones (table, bench.md and bench.json), and records the draft length."""
    drafter = _family_drafter(setup, "dspark", "DSparkDraftModel", DSPARK)
    rep = run_bench(
        config(
            setup,
            tmp_path,
            drafter=str(drafter),
            methods=["baseline", "hf", "dflash"],
            draft_cutoff=0.05,
            draft_length="confidence",
            plots=False,
        ),
        say=lambda m: None,
        progress=False,
    )
    rows = {r["method"]: r for r in rep["rows"]}
    d = rows["dflash"]
    assert rep["mismatches"] == [] and d["exact"] == "yes"
    assert len(d["per_position_acceptance"]) == 3 and len(d["predicted_per_position"]) == 3
    assert all(0.0 <= p <= 1.0 for p in d["predicted_per_position"])
    assert d["predicted_tau"] == pytest.approx(1.0 + sum(d["predicted_per_position"]))
    assert rows["baseline"]["predicted_tau"] is None and rows["hf"]["predicted_per_position"] is None
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["config"]["draft_length"] == "confidence" and saved["config"]["draft_cutoff"] == 0.05
    js = {r["method"]: r for r in saved["rows"]}["dflash"]
    assert js["predicted_per_position"] == pytest.approx(d["predicted_per_position"])
    assert any("predicted_at" in p for p in saved["per_prompt"] if p["method"] == "dflash")
    md = (tmp_path / "bench.md").read_text()
    assert "pred. tau" in md and "draft length confidence" in md


def test_bench_domino_drafter_runs_on_pytorch(setup, tmp_path):
    drafter = _family_drafter(setup, "domino", "DominoDraftModel", {"emb_dim": 16, "gru_hidden_dim": 16})
    rep = run_bench(
        config(setup, tmp_path, drafter=str(drafter), methods=["hf", "dflash"], plots=False),
        say=lambda m: None,
        progress=False,
    )
    d = {r["method"]: r for r in rep["rows"]}["dflash"]
    assert rep["mismatches"] == [] and d["exact"] == "yes" and d["predicted_tau"] is None
    assert len(d["per_position_acceptance"]) == 3
