"""EngineOptions is the one home of the engine's options: every entry point takes the same proposer choices and
starts from the same default (decoding/options.py), so a build, a benchmark, `eval`, the server and the Python
API decode alike unless told otherwise."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
from click.testing import CliRunner

from dflash_trt.bench.runner import BenchConfig
from dflash_trt.cli import main
from dflash_trt.decoding.engine import SpecEngine
from dflash_trt.decoding.loop import generate
from dflash_trt.decoding.options import DEFAULT_PROPOSER, EngineOptions
from dflash_trt.deploy.build_config import BuildConfig
from dflash_trt.errors import ConfigError
from dflash_trt.serving.repo import default_values
from dflash_trt.train.evaluate import evaluate

CHOICES = dataclasses.fields(EngineOptions)[0].metadata["choices"]


def test_proposer_is_the_first_option_and_offers_auto():
    assert dataclasses.fields(EngineOptions)[0].name == "proposer"
    assert "auto" in CHOICES and DEFAULT_PROPOSER in CHOICES


def test_one_default_proposer_everywhere(tmp_path):
    assert EngineOptions().proposer == DEFAULT_PROPOSER
    assert BuildConfig(target="t", drafter="d").proposer == DEFAULT_PROPOSER
    assert BenchConfig(target="t").proposer == DEFAULT_PROPOSER
    assert inspect.signature(evaluate).parameters["proposer"].default == DEFAULT_PROPOSER
    assert default_values(tmp_path, tmp_path)["proposer"] == DEFAULT_PROPOSER
    # the Python API's engine and generate() take EngineOptions' default (no default of their own)
    assert "proposer" not in inspect.signature(SpecEngine).parameters
    assert "proposer" not in inspect.signature(generate).parameters
    for cmd in ("generate", "eval", "bench"):  # the CLI's flags are generated from the same field
        out = CliRunner().invoke(main, [cmd, "--help"], terminal_width=400).output
        flag = out.split("\n  --proposer [", 1)[1].split("\n  --", 1)[0]  # the flag's own help block
        assert f"[default: {DEFAULT_PROPOSER}]" in flag, cmd


@pytest.mark.parametrize("proposer", CHOICES)
def test_every_entry_point_takes_every_proposer(proposer):
    BuildConfig(target="t", drafter="d", proposer=proposer)
    BenchConfig(target="t", proposer=proposer)
    EngineOptions(proposer=proposer)
    out = CliRunner().invoke(main, ["serve", "--help"], terminal_width=400).output
    assert proposer in out.split("\n  --proposer [", 1)[1].split("]", 1)[0]


def test_an_unknown_proposer_is_one_line_everywhere():
    for make in (
        lambda: BuildConfig(target="t", drafter="d", proposer="suffix"),
        lambda: BenchConfig(target="t", proposer="suffix"),
    ):
        with pytest.raises(ConfigError, match="proposer='suffix'"):
            make()
    with pytest.raises(ConfigError, match="proposer='suffix': choose one of"):
        EngineOptions(proposer="suffix")
