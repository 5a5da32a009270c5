"""quickstart: runs the drafter at --block-size (at most its trained block), exact, with clear errors."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from conftest import tiny_drafter, tiny_model_dir

from dflash_trt import quickstart
from dflash_trt.cli import main
from dflash_trt.errors import ConfigError
from dflash_trt.quickstart import QuickstartConfig, run_quickstart


@pytest.fixture
def tiny_setup(tmp_path, monkeypatch):
    from dflash_trt.api import load_target

    folder = str(tiny_model_dir(tmp_path / "t"))
    target, _ = load_target(folder, "float32", progress=False, device="cpu")
    tiny_drafter(target, block_size=6).save_pretrained(tmp_path / "d")
    monkeypatch.setattr(quickstart, "obtain_drafter", lambda cfg, t, tok: (tmp_path / "d", "test drafter"))
    return folder


@pytest.mark.parametrize("run_block, used", [(3, 3), (6, 6), (16, 6), (None, 4)])  # 16 > trained 6; None: 4 on CPU
def test_quickstart_runs_at_the_block_asked(tiny_setup, run_block, used):
    res = run_quickstart(QuickstartConfig(target=tiny_setup, max_new_tokens=12, repeats=1, run_block_size=run_block))
    assert res["block_size"] == used and res["identical"]
    assert len(res["per_position_acceptance"]) == used - 1


def test_quickstart_block_size_refused():
    with pytest.raises(ConfigError, match="run_block_size=1"):
        QuickstartConfig(run_block_size=1)
    out = CliRunner().invoke(main, ["quickstart", "--block-size", "1"])
    assert out.exit_code == 2 and "run_block_size=1" in out.output and "Traceback" not in out.output
