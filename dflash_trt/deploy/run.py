"""`run_build`: the stages in order, into a temp dir renamed into place, with a stage-level cache.

Boundary: orchestration only (what each stage does is in deploy/stages.py). Guarantees:
  * the build happens in `.OUT.build-<pid>-*` next to OUT and replaces OUT only when every stage
    succeeded: a failed or interrupted build leaves no half-written OUT, and an earlier OUT intact;
  * an earlier OUT is a cache: a stage whose key (hash of the input files, the options it reads,
    the keys of the stages it depends on, and OUT's path, which is written into files) matches
    the earlier build.json is not run again: its folder is hard-linked over. `force` rebuilds all.
    `check` runs every time (its refusals read options its outputs do not depend on).
OUT/build.json records inputs with sha256, package versions, options, per-stage status, time,
key, outputs and info (the eval numbers among them).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import platform
import re
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from dflash_trt.atomic import atomic_dir
from dflash_trt.deploy import stages as S
from dflash_trt.deploy.build_config import BuildConfig
from dflash_trt.deploy.check import resolve_inputs
from dflash_trt.deploy.files import copy_tree, write_json
from dflash_trt.errors import DFlashError

SCHEMA = 1
MANIFEST = "build.json"
PACKAGES = (
    "dflash-trt",
    "torch",
    "transformers",
    "safetensors",
    "tokenizers",
    "numpy",
    "PyYAML",
    "tensorrt_llm",
    "tensorrt",
    "nvidia-modelopt",
    "triton",
    "tritonclient",
    "nvidia-pytriton",
)
MODEL_OPTS = (
    "target",
    "drafter",
    "tokenizer",
    "backend",
    "target_quant",
    "drafter_quant",
    "kv_cache",
    "sm",
    "tp_size",
    "max_batch",
    "max_seq_len",
)

# what the engine stage reads (torch engine folder, trtllm-pytorch model.yaml)
ENGINE_OPTS = (
    "backend",
    "dtype",
    "max_batch",
    "max_seq_len",
    "tp_size",
    "pp_size",
    "ep_size",
    "kv_cache",
    "cuda_graph_batch_sizes",
    "attention_backend",
    "sm",
)


@dataclass(frozen=True)
class Stage:
    name: str
    fn: Callable
    outputs: tuple[str, ...]  # folders under OUT this stage owns
    options: tuple[str, ...]  # BuildConfig fields it reads (part of its cache key)
    after: tuple[str, ...] = ()  # stages whose outputs it reads
    needed: Callable[[BuildConfig], bool] = lambda cfg: True
    # run on every build, never reused: `check` refuses what the engine and the emitted engines cannot
    # run, which reads more options (draft length, proposer, emit, parallelism) than its outputs do,
    # and it is cheap (config files and safetensors headers)
    always: bool = False


STAGES = (
    Stage("check", S.stage_check, ("check",), MODEL_OPTS, always=True),
    Stage(
        "quantize",
        S.stage_quantize,
        ("quantized",),
        ("target_quant", "drafter_quant", "kv_cache", "calib_prompts", "calib_source", "calib_seq_len", "max_seq_len")
        + ("awq",),
        ("check",),
        lambda c: c.quantized,
    ),
    Stage(
        "engine",
        S.stage_engine,
        ("engine",),
        ENGINE_OPTS,
        ("check", "quantize"),
    ),
    Stage(
        "repo",
        S.stage_repo,
        ("model_repo",),
        (
            "backend",
            "max_batch",
            "max_seq_len",
            "dtype",
            "triton_max_batch_size",
            "instance_count",
            "chat",
            "decoupled",
            "cpu_threads",
            "draft_cutoff",
            "draft_length",
            "proposer",
            "max_queue",
        ),
        ("engine",),
    ),
    Stage(
        "emit",
        S.stage_emit,
        ("serve",),
        # what emit.py / emit_layout.py read: its own options and the engine's but backend, sm and
        # attention_backend (no emitted flag depends on them)
        ("emit", "draft_length", "target_quant", "drafter_quant")
        + tuple(o for o in ENGINE_OPTS if o not in ("backend", "sm", "attention_backend")),
        ("check", "quantize"),
        lambda c: bool(c.emit),
    ),
    Stage(
        "eval",
        S.stage_eval,
        ("eval",),
        ("eval_prompts", "eval_source", "eval_max_new_tokens", "dtype", "max_seq_len"),
        ("check", "quantize"),
        lambda c: c.quantized and c.eval_prompts > 0,
    ),
)
STAGE_NAMES = tuple(s.name for s in STAGES)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def hash_inputs(dirs: dict[str, Path]) -> dict:
    """sha256 of every (top-level, non-hidden) file of the target / drafter / tokenizer folders."""
    out = {}
    for name, d in dirs.items():
        out[name] = {
            "path": str(d),
            "files": {
                f.name: sha256_file(f) for f in sorted(d.iterdir()) if f.is_file() and not f.name.startswith(".")
            },
        }
    return out


def package_versions() -> dict:
    out = {"python": platform.python_version(), "platform": platform.platform()}
    for p in PACKAGES:
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            out[p] = None
    return out


def _key(stage: Stage, cfg: BuildConfig, inputs: dict, keys: dict, out: Path) -> str:
    blob = {
        "schema": SCHEMA,
        "stage": stage.name,
        "out": str(out),
        "after": [keys.get(a) for a in stage.after],
        "options": {o: getattr(cfg, o) for o in stage.options},
        "inputs": {k: v["files"] for k, v in inputs.items()},
    }
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()


def read_manifest(out: Path) -> dict | None:
    try:
        m = json.loads((out / MANIFEST).read_text())
        return m if m.get("schema") == SCHEMA else None
    except (OSError, ValueError):
        return None


def _selected(only: str | None) -> set[str]:
    """`only` and the stages it transitively depends on (all stages when None)."""
    if only is None:
        return set(STAGE_NAMES)
    if only not in STAGE_NAMES:
        raise DFlashError(f"stage {only!r}: unknown; stages: {', '.join(STAGE_NAMES)}")
    by_name, want, todo = {s.name: s for s in STAGES}, set(), [only]
    while todo:
        n = todo.pop()
        if n not in want:
            want.add(n)
            todo.extend(by_name[n].after)
    return want


def _clean_stale_temps(out: Path) -> None:
    """Temp dirs of builds that were killed (their pid is gone)."""
    pat = re.compile(rf"^\.{re.escape(out.name)}\.(?:build|old)-(\d+)-")
    for p in out.parent.glob(f".{out.name}.*"):
        m = pat.match(p.name)
        if m and p.is_dir() and not Path(f"/proc/{m.group(1)}").exists():
            shutil.rmtree(p, ignore_errors=True)


def run_build(
    cfg: BuildConfig,
    out_dir: str | Path,
    force: bool = False,
    only: str | None = None,
    echo: Callable[[str], None] = print,
    progress: bool = True,
) -> dict:
    """Run the build (or `only` one stage plus what it depends on) into out_dir; returns build.json."""
    out = Path(out_dir).expanduser().resolve()
    want = _selected(only)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MANIFEST).is_file())):
        raise DFlashError(
            f"--out {out}: exists and is not a dflash-trt build folder (no {MANIFEST}); "
            f"choose a new or empty folder"
        )
    dirs = resolve_inputs(cfg, progress)
    inputs = hash_inputs(dirs)
    old = None if force else read_manifest(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _clean_stale_temps(out)
    manifest = {
        "schema": SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "config": cfg.to_dict(),
        "inputs": inputs,
        "versions": package_versions(),
        "stages": {},
    }
    keys: dict[str, str] = {}
    # failures and Ctrl-C alike drop the temp dir and keep the earlier OUT (dflash_trt/atomic.py)
    with atomic_dir(out, tag=f"build-{os.getpid()}") as tmp:
        ctx = S.Context(cfg=cfg, work=tmp, final=out, dirs=dirs, echo=echo, progress=progress)
        for st in STAGES:
            key = keys[st.name] = _key(st, cfg, inputs, keys, out)
            rec: dict = {"key": key, "outputs": list(st.outputs)}
            prev = (old or {}).get("stages", {}).get(st.name, {})
            if not st.needed(cfg):
                rec.update(status="not needed", outputs=[])
            elif (
                not st.always
                and prev.get("key") == key
                and prev.get("status") in ("ran", "cached")
                and all((out / o).exists() for o in st.outputs)
            ):
                for o in st.outputs:
                    copy_tree(out / o, tmp / o)
                rec.update(status="cached", seconds=0.0, info=prev.get("info", {}))
                ctx.info[st.name] = rec["info"]
                echo(f"{st.name}: unchanged, reused from the previous build")
            elif st.name in want:
                t0 = time.perf_counter()
                info = st.fn(ctx)
                rec.update(status="ran", seconds=round(time.perf_counter() - t0, 3), info=info)
                ctx.info[st.name] = info
            else:
                rec.update(status="not run", outputs=[])
            manifest["stages"][st.name] = rec
        if manifest["stages"]["eval"].get("info"):
            manifest["eval"] = manifest["stages"]["eval"]["info"]
        write_json(tmp / MANIFEST, manifest)
    return manifest


def stage_table(manifest: dict) -> list[tuple[str, str, str]]:
    """(stage, status, seconds) rows for printing."""
    return [(n, r["status"], f"{r['seconds']:.1f}s" if r.get("seconds") else "") for n, r in manifest["stages"].items()]


def config_from_manifest(manifest: dict) -> BuildConfig:
    return BuildConfig(
        **{f.name: manifest["config"][f.name] for f in dataclasses.fields(BuildConfig) if f.name in manifest["config"]}
    )
