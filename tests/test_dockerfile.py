"""The Dockerfile, without a Docker engine: what it copies exists, the extras it installs exist, its base
image tag is not guessed, it checks the image's TensorRT-LLM, and what it pip-installs resolves on PyPI
for the NGC image's Python 3.12 on glibc 2.39 (skipped, with the reason, only when PyPI is unreachable)."""

from __future__ import annotations

import json
import os
import re
import shlex
import ssl
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli", reason="Python 3.10 reads pyproject.toml with tomli (pip install tomli)")

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = (ROOT / "Dockerfile").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS = PYPROJECT["project"]["optional-dependencies"]
# the Triton trtllm-python-py3 images: Python 3.12.3 (Triton Release Compatibility Matrix) on Ubuntu 24.04
IMAGE_PYTHON = "3.12"
IMAGE_PLATFORMS = [f"manylinux_2_{m}_x86_64" for m in range(39, 16, -1)] + ["manylinux2014_x86_64"]


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per Dockerfile instruction, continuation lines joined, comments dropped."""
    lines = [ln for ln in DOCKERFILE.splitlines() if not ln.lstrip().startswith("#")]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(m.group(1).upper(), m.group(2)) for m in re.finditer(r"^\s*(\w+)\s+(.*)$", text, re.M)]


def installed_spec() -> tuple[list[str], list[str]]:
    """(extras of the local package, other requirement strings) of the Dockerfile's `pip install`."""
    runs = [args for ins, args in instructions() if ins == "RUN" and "pip install" in args]
    assert len(runs) == 1, runs
    words = [w for w in shlex.split(runs[0].split("pip install", 1)[1]) if not w.startswith("-")]
    local = [w for w in words if w == "." or w.startswith(".[")]
    assert local == [words[0]], f"the Dockerfile installs the checkout first: {words}"
    extras = re.fullmatch(r"\.(?:\[([\w,-]*)\])?", local[0]).group(1)
    return [e.strip() for e in (extras or "").split(",") if e.strip()], words[1:]


def test_every_copied_path_exists():
    copies = [args.split() for ins, args in instructions() if ins == "COPY"]
    assert copies
    for args in copies:
        assert not any(a.startswith("--from") for a in args)
        for src in args[:-1]:
            assert (ROOT / src).exists(), f"COPY {src}: not in the checkout"
    assert not any("plugins" in a for args in copies for a in args)  # the TensorRT plugins are gone


def test_every_installed_extra_exists_and_none_is_removed():
    extras, _ = installed_spec()
    assert set(extras) == {"serve", "kernels"}
    for e in extras:
        assert e in EXTRAS, f"extra [{e}] is not in pyproject.toml ({', '.join(EXTRAS)})"
    assert "trt" not in EXTRAS  # the TensorRT engine extra was removed with trtllm-build


def test_base_image_is_the_triton_trtllm_image_with_a_required_tag():
    args = dict(re.findall(r"^ARG (\w+)=(\S*)", DOCKERFILE, re.M))
    froms = [a for ins, a in instructions() if ins == "FROM"]
    assert froms == ["nvcr.io/nvidia/tritonserver:${TRITON_TAG}-trtllm-python-py3"]
    # no release is listed with TensorRT-LLM >= 1.3: the default must not look like one (yy.mm)
    assert not re.fullmatch(r"\d\d\.\d\d", args["TRITON_TAG"]) and "REQUIRED" in args["TRITON_TAG"]
    tag = f"{args['TRITON_TAG']}-trtllm-python-py3"
    assert re.fullmatch(r"[\w][\w.-]{0,127}", tag), "the placeholder must be a valid tag so the pull error names it"


def test_first_step_checks_the_images_tensorrt_llm_is_at_least_1_3():
    runs = [a for ins, a in instructions() if ins == "RUN"]
    check = runs[0]
    assert "m.version('tensorrt_llm')" in check and ">= (1, 3)" in check
    code = re.search(r'python3 -c "(.*)"$', check).group(1)
    code = code.replace("m.version('tensorrt_llm')", "VERSION")
    for version, ok in (("1.3.0", True), ("1.3.0rc16", True), ("1.10.1", True), ("1.2.1", False), ("0.21.0", False)):
        r = subprocess.run([sys.executable, "-c", code.replace("VERSION", repr(version))], capture_output=True)
        assert (r.returncode == 0) is ok, (version, r.stdout)


def test_default_command_is_dflash_trt_serve():
    cmd = [a for ins, a in instructions() if ins == "CMD"]
    assert json.loads(cmd[-1])[:2] == ["dflash-trt", "serve"]
    # a remote client reaches it: every Triton endpoint binds all of the container's interfaces,
    # with options `dflash-trt serve` takes
    from dflash_trt.cli import main

    args = json.loads(cmd[-1])[2:]
    assert all(
        f"--{e}-address" in args and args[args.index(f"--{e}-address") + 1] == "0.0.0.0"
        for e in ("grpc", "http", "metrics")
    )
    ctx = main.commands["serve"].make_context("serve", list(args), resilient_parsing=True)
    assert ctx.params["grpc_address"] == "0.0.0.0" and ctx.params["model_repo"] == "/work/out/model_repo"


def _pypi_unreachable() -> str | None:
    ctx = ssl.create_default_context(cafile=os.environ.get("PIP_CERT") or None)
    try:
        urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=10, context=ctx).close()
    except OSError as e:
        return f"PyPI unreachable ({e})"
    return None


def test_what_the_dockerfile_installs_resolves_on_pypi(tmp_path):
    """Each requirement of the package and of the extras it installs has a wheel for the image's Python and
    platform (pip --dry-run --no-deps: one lookup per requirement, seconds; the image's own torch and
    tensorrt_llm then satisfy the rest)."""
    why = _pypi_unreachable()
    if why:
        pytest.skip(why)
    extras, others = installed_spec()
    reqs = list(PYPROJECT["project"]["dependencies"]) + [r for e in extras for r in EXTRAS[e]] + others
    reqs = [r.split(";")[0].strip() for r in reqs]
    # --target: pip before 23.3 (a fresh venv's) accepts --platform / --python-version only with it
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--target", str(tmp_path), "--no-deps", "--quiet"]
    cmd += ["--only-binary=:all:", "--python-version", IMAGE_PYTHON, "--timeout", "20", "--retries", "1"]
    cmd += [f"--platform={p}" for p in IMAGE_PLATFORMS] + ["--report", "-", *reqs]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)
    got = {re.sub(r"[-_.]+", "-", i["metadata"]["name"]).lower() for i in report["install"]}
    want = {re.sub(r"[-_.]+", "-", re.match(r"[\w.-]+", q).group(0)).lower() for q in reqs}
    assert got == want
