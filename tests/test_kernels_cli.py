"""`dflash-trt kernels compile` / `kernels list` (kernels/cli.py): one real AOT compile, errors."""

import importlib.util
import json

import pytest
from click.testing import CliRunner

from dflash_trt.cli import main

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@needs_triton
def test_kernels_compile_one_arch_subset_then_list(tmp_path, monkeypatch):
    # spawned compile workers: correct whatever mode this process imported triton in
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "kernels"
    res = run("kernels", "compile", "--arch", "sm_90", "--out", out, "--only", "greedy_accept_argmax", "--jobs", "1")
    assert res.exit_code == 0, res.output
    assert "[1/1] sm_90 greedy_accept_argmax" in res.output
    assert f"manifest: {out / 'manifest.json'}" in res.output and "sm_90" in res.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert [(e["name"], e["arch"]) for e in manifest["kernels"]] == [("greedy_accept_argmax", "sm_90")]
    assert (out / "sm_90" / "greedy_accept_argmax.cubin").read_bytes()[:4] == b"\x7fELF"

    res = run("kernels", "list", out)
    assert res.exit_code == 0, res.output
    assert "greedy_accept_argmax" in res.output and "sm_90" in res.output
    (out / "sm_90" / "greedy_accept_argmax.cubin").write_bytes(b"tampered")
    res = run("kernels", "list", out)
    assert res.exit_code == 2 and "greedy_accept_argmax.cubin: sha256 mismatch" in res.output


def test_kernels_compile_bad_arch_is_one_error_line(tmp_path):
    out = tmp_path / "kernels"
    res = run("kernels", "compile", "--arch", "sm_90,sm_75", "--out", out)
    assert res.exit_code == 2
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert lines == [
        "error: --arch 'sm_75': expected a comma-separated list of sm_90, sm_100, sm_120 "
        "(Hopper, Blackwell datacenter, Blackwell consumer)"
    ]
    assert not out.exists()


def test_kernels_compile_only_and_list_errors(tmp_path):
    res = run("kernels", "compile", "--arch", "90,sm_100", "--only", "no_such_kernel", "--out", tmp_path / "x")
    assert res.exit_code == 2 and res.output.startswith("error: --only no_such_kernel: matches no kernel")
    res = run("kernels", "compile", "--arch", "sm_100a", "--only", "greedy", "--list")
    assert res.exit_code == 0 and res.output.split() == [
        "greedy_accept_argmax",
        "greedy_accept_logits_fp32",
        "greedy_accept_logits_bf16",
    ]
    res = run("kernels", "list", tmp_path)
    assert res.exit_code == 2 and "no manifest.json" in res.output
