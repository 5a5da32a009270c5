"""The `dflash-trt` command as a user meets it: output, statistics, and one-line errors."""

import json

import pytest
import torch
from click.testing import CliRunner
from conftest import tiny_model_dir

from dflash_trt.cli import main
from dflash_trt.config import DrafterConfig
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
    res = generate_vs_baseline(pair, "--draft-cutoff", 0.5)
    # an untrained drafter is never this sure: every step verifies the last token alone
    assert res["stats"]["num_draft_tokens"] == 0 and res["stats"]["tau"] == 1.0


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
