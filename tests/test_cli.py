"""The `dflash-trt` command as a user meets it: output, statistics, and one-line errors."""

import json

import pytest
import torch
from click.testing import CliRunner
from conftest import tiny_model_dir

from dflash_trt.cli import main
from dflash_trt.config import DrafterConfig
from dflash_trt.decoding.verify_cost import VerifyCost
from dflash_trt.modeling.drafter import DFlashDrafter
from dflash_trt.modeling.target import TargetModel


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    target_dir = tiny_model_dir(root / "target")
    t = TargetModel.from_pretrained(target_dir, dtype=torch.float32)
    torch.manual_seed(0)
    DFlashDrafter(DrafterConfig.for_target(t.config, num_layers=1, block_size=4)).save_pretrained(root / "drafter")
    return root, target_dir


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def generate(pair, *args):
    """`generate` with the tiny target and drafter."""
    root, target = pair
    return run("generate", "--target", target, "--drafter", root / "drafter", *args)


def generate_vs_baseline(pair, *extra) -> dict:
    """`generate --baseline --json` (fp32, 12 tokens of "def add"): its JSON, checked identical to the target alone."""
    r = generate(
        pair, "--prompt", "def add", "--max-new-tokens", 12, "--baseline", "--json", "--dtype", "float32", *extra
    )
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert res["identical_to_baseline"] is True
    return res


def test_generate_json_matches_baseline(pair):
    res = generate_vs_baseline(pair)
    assert res["stats"]["num_output_tokens"] == len(res["tokens"]) <= 12
    assert res["speedup"] > 0
    s = res["stats"]  # tau = tokens per verify step, bonus included, from the counts reported beside it
    steps, accepted = s["num_verify_steps"], s["num_accepted_draft_tokens"]
    assert steps > 0 and s["tau"] == pytest.approx((accepted + steps) / steps) and 1.0 <= s["tau"] <= 4  # block 4
    assert sum(s["accept_hist"]) == steps and sum(k * h for k, h in enumerate(s["accept_hist"])) == accepted + steps
    assert accepted + steps >= s["num_output_tokens"] - 1  # every token after the first came from a verify step


def test_generate_with_draft_cutoff_matches_baseline(pair):
    res = generate_vs_baseline(pair, "--draft-cutoff", 0.5, "--proposer", "dflash")  # the drafter's drafts alone
    # an untrained drafter is never this sure: every step verifies the last token alone
    assert res["stats"]["num_draft_tokens"] == 0 and res["stats"]["tau"] == 1.0


def test_generate_with_penalties_matches_the_penalised_baseline(pair):
    """The penalties change the output (against plain greedy) and DFlash still equals the target alone
    under the same penalties (decoding/penalties.py applies them per verify-block position)."""
    plain = generate_vs_baseline(pair, "--no-chat")
    res = generate_vs_baseline(pair, "--no-chat", "--repetition-penalty", 2.0, "--frequency-penalty", 1.5)
    assert res["tokens"] != plain["tokens"]
    r = generate(pair, "--prompt", "hi", "--min-tokens", 999)
    assert r.exit_code != 0 and r.output.count("\n") == 1 and "min_tokens" in r.output, r.output


@pytest.mark.parametrize("proposer", ["ngram", "hybrid", "auto"])
def test_generate_with_proposer_matches_baseline(pair, proposer, monkeypatch):
    """--proposer ngram / hybrid / auto (hybrid for a DFlash drafter): the same greedy output as
    the target alone, the drafts' sources in the stats (ngram never runs the drafter: every draft it verifies
    is copied from the prompt and output). A flat verify cost (every width as cheap as one token): the
    hybrid's choices then do not follow this machine's timings, which a busy CPU skews."""
    monkeypatch.setattr(VerifyCost, "measure", classmethod(lambda cls, *a, **k: cls([1, 512], [1.0, 1.0])))
    prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add"
    args = (("--proposer", proposer) if proposer else ()) + ("--prompt", prompt, "--no-chat", "--max-new-tokens", 24)
    res = generate_vs_baseline(pair, *args)  # the later --max-new-tokens wins
    s = res["stats"]
    src = s["sources"]
    assert src["copied"]["steps"] > 0 and src["copied"]["accepted"] > 0  # the tiny target repeats itself
    assert src["drafter"]["steps"] + src["copied"]["steps"] == s["num_verify_steps"]
    assert src["drafter"]["drafts"] + src["copied"]["drafts"] == s["num_draft_tokens"]
    assert src["drafter"]["accepted"] + src["copied"]["accepted"] == s["num_accepted_draft_tokens"]
    if proposer == "ngram":
        assert src["drafter"]["drafts"] == 0
    r = generate(pair, *args, "--dtype", "float32")
    assert r.exit_code == 0 and "draft sources" in r.output and "copied" in r.output, r.output


def test_generate_proposer_errors_are_one_line(pair):
    r = generate(pair, "--prompt", "hi", "--proposer", "suffix")
    assert r.exit_code == 2 and "dflash" in r.output and "ngram" in r.output and "hybrid" in r.output, r.output
    r = generate(pair, "--prompt", "hi", "--proposer", "ngram", "--draft-cutoff", 0.3)  # the engine's refusal
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    (err,) = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert "proposer=ngram" in err


def test_generate_text_output_and_stats(pair):
    r = generate(pair, "--prompt", "hello", "--no-chat", "--max-new-tokens", 8, "--temperature", 0.7, "--seed", 3)
    assert r.exit_code == 0, r.output
    assert "acceptance length tau" in r.output and "drafts verified" in r.output and "per step (of 3)" in r.output


def test_no_drafter_explains_how_to_get_one(pair):
    _, target = pair
    r = run("generate", "--target", target, "--prompt", "hi")
    assert r.exit_code == 2
    assert "no drafter given" in r.output and "dflash-trt train" in r.output and "Traceback" not in r.output


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--block-size", "1"], "--block-size 1: must be >= 2"),
        (["--temperature", "-1"], "temperature=-1.0"),
        (["--top-p", "0"], "top_p=0.0"),
        (["--draft-cutoff", "1"], "--draft-cutoff"),
    ],
)
def test_bad_flags_one_line_errors(pair, args, needle):
    r = generate(pair, "--prompt", "hi", *args)
    assert r.exit_code == 2 and needle in r.output, r.output


def test_draft_length_confidence_errors_are_one_line(pair):
    r = generate(pair, "--prompt", "hi", "--draft-length", "confidence")  # no cutoff
    assert r.exit_code == 2 and "--draft-length=confidence needs draft_cutoff > 0" in r.output, r.output
    assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1
    r = generate(pair, "--prompt", "hi", "--draft-length", "confidence", "--draft-cutoff", 0.3)  # plain DFlash
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    (err,) = [line for line in r.output.splitlines() if line.startswith("error:")]  # after load progress lines
    assert "no confidence head" in err and "draft_length=block" in err
    r = generate(pair, "--prompt", "hi", "--draft-length", "nope")
    assert r.exit_code == 2 and "block" in r.output and "confidence" in r.output


@pytest.fixture(scope="module")
def dspark_dir(pair):
    """A tiny DSpark drafter with a (random) confidence head for the module's target."""
    import dataclasses

    from dflash_trt.families import for_architectures

    root, target_dir = pair
    t = TargetModel.from_pretrained(target_dir, dtype=torch.float32)
    cfg = DrafterConfig.for_target(t.config, num_layers=1, block_size=4)
    fields = {"markov_rank": 8, "markov_head_type": "rnn", "enable_confidence_head": True}
    fields = {**for_architectures(["DSparkDraftModel"]).DEFAULTS, **fields}
    cfg = dataclasses.replace(cfg, architectures=["DSparkDraftModel"], family_fields=fields)
    torch.manual_seed(0)
    DFlashDrafter(cfg).bind(t).save_pretrained(root / "dspark")
    return root / "dspark"


def test_generate_dspark_confidence_reports_predicted_tau(pair, dspark_dir):
    _, target = pair
    args = ["generate", "--target", target, "--drafter", dspark_dir, "--prompt", "def add", "--max-new-tokens", 12]
    args += ["--dtype", "float32", "--draft-length", "confidence", "--draft-cutoff", 0.05]
    r = run(*args, "--baseline", "--json")
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert res["identical_to_baseline"] is True
    s = res["stats"]
    assert len(s["per_position_acceptance"]) == 3 and len(s["predicted_per_position"]) == 3
    assert s["predicted_tau"] == pytest.approx(1 + sum(s["predicted_per_position"]))
    r = run(*args)
    assert r.exit_code == 0, r.output
    assert "predicted tau" in r.output and "predicted per position" in r.output


def test_missing_and_corrupt_drafter(pair, tmp_path):
    root, target = pair
    r = run("generate", "--target", target, "--drafter", tmp_path / "nope", "--prompt", "hi")
    assert r.exit_code == 2 and "not a folder" in r.output
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text("{not json")
    r = run("generate", "--target", target, "--drafter", tmp_path / "d", "--prompt", "hi")
    assert r.exit_code == 2 and "not valid JSON" in r.output


def test_incompatible_drafter(pair, tmp_path):
    root, target = pair
    cfg = json.loads((root / "drafter" / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [0, 9]
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "d" / "model.safetensors").write_bytes((root / "drafter" / "model.safetensors").read_bytes())
    r = run("generate", "--target", target, "--drafter", tmp_path / "d", "--prompt", "hi")
    assert r.exit_code == 2 and "target_layer_ids [9]" in r.output, r.output


def test_prompt_longer_than_context(pair, tmp_path):
    r = generate(pair, "--prompt", "word " * 600, "--no-chat")
    assert r.exit_code == 2 and "context" in r.output and "max_seq_len" in r.output, r.output


def test_unknown_target_name():
    r = run("generate", "--target", "no-such-model", "--random-drafter", "--prompt", "hi")
    assert r.exit_code == 2 and "no-such-model" in r.output
