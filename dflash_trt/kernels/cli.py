"""`dflash-trt kernels compile` and `dflash-trt kernels list`: thin shells over kernels/aot.py.

compile: every kernel specialisation of aot.default_specs() (or the --only subset) for every
--arch, into --out (cubin + PTX + manifest.json; written atomically, so a failed
compile leaves --out untouched). Needs Triton (its wheel ships ptxas), no GPU.
list: the manifest of such a folder as a table, sha256 of every file re-checked.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import click

from dflash_trt.cli_shared import friendly_errors
from dflash_trt.errors import DFlashError
from dflash_trt.kernels import aot, triton_available
from dflash_trt.kernels.aot import ARCHS, MANIFEST, default_specs, load_manifest


def parse_archs(text: str) -> list[str]:
    """'sm_90,sm_100' (also '90', 'sm_90a') -> ['sm_90', 'sm_100']; DFlashError naming --arch."""
    archs = []
    for part in (p.strip() for p in text.split(",")):
        s = part.lower().removeprefix("sm_").rstrip("af")
        arch = f"sm_{s}" if s.isdigit() else None
        if arch not in ARCHS:
            raise DFlashError(
                f"--arch {part!r}: expected a comma-separated list of {', '.join(ARCHS)} "
                f"(Hopper, Blackwell datacenter, Blackwell consumer)"
            )
        if arch not in archs:
            archs.append(arch)
    return archs


def select_specs(only: tuple[str, ...]):
    specs = default_specs()
    if not only:
        return specs
    chosen = [s for s in specs if any(o in s.name for o in only)]
    if not chosen:
        raise DFlashError(
            f"--only {', '.join(only)}: matches no kernel; names are e.g. "
            f"{', '.join(s.name for s in specs[:3])} (see `dflash-trt kernels compile --list`)"
        )
    return chosen


def manifest_table(manifest: dict, title: str):
    # deferred: rich takes ~0.1 s to import, and `dflash-trt --help` imports this module
    from rich.table import Table

    t = Table(title=title)
    for col, just in (
        ("kernel", "left"),
        ("arch", "left"),
        ("warps", "right"),
        ("shared mem", "right"),
        ("cubin", "right"),
        ("cubin sha256", "left"),
    ):
        t.add_column(col, justify=just)
    for e in sorted(manifest["kernels"], key=lambda e: (e["name"], int(e["arch"][3:]))):
        cub = e["files"]["cubin"]
        t.add_row(
            e["name"],
            e["arch"],
            str(e["num_warps"]),
            f"{e['shared_mem'] / 1024:.1f} KiB",
            f"{cub['bytes'] / 1024:.0f} KiB",
            cub["sha256"][:12],
        )
    return t


def _require_triton() -> None:
    if not triton_available():
        raise DFlashError("Triton is not installed: pip install 'dflash-trt[kernels]' (no GPU needed)")


def register(main: click.Group) -> None:
    @main.group()
    def kernels():
        """DFlash GPU kernels: ahead-of-time compile for Hopper / Blackwell without a GPU, list."""

    @kernels.command("compile")
    @click.option(
        "--arch",
        "arch_text",
        default="sm_90,sm_100,sm_120",
        show_default=True,
        help="Comma-separated GPU architectures.",
    )
    @click.option("--out", "out_dir", default="kernels_build", show_default=True, help="Output folder.")
    @click.option("--only", multiple=True, help="Compile only kernels whose name contains this (repeatable).")
    @click.option("--jobs", type=int, default=None, help="Compile processes (default: CPU count).")
    @click.option("--list", "list_only", is_flag=True, help="Print the kernel names and exit.")
    @friendly_errors
    def kernels_compile(arch_text, out_dir, only, jobs, list_only):
        """Compile every DFlash kernel for each --arch into --out, with manifest.json."""
        archs = parse_archs(arch_text)
        specs = select_specs(only)
        if list_only:
            for s in specs:
                click.echo(s.name)
            return
        _require_triton()
        # deferred: rich takes ~0.1 s to import, and `dflash-trt --help` imports this module
        from rich.console import Console

        jobs = jobs or min(len(specs) * len(archs), os.cpu_count() or 1)
        total, done = len(specs) * len(archs), []
        click.echo(
            f"compiling {len(specs)} kernels x {len(archs)} archs ({', '.join(archs)}) "
            f"with {jobs} job(s) into {out_dir}",
            err=True,
        )
        t0 = time.perf_counter()

        def progress(entry):
            done.append(entry)
            click.echo(
                f"  [{len(done)}/{total}] {entry['arch']} {entry['name']} " f"({time.perf_counter() - t0:.0f}s)",
                err=True,
            )

        try:
            path = aot.compile_all(archs, out_dir, specs=specs, jobs=jobs, progress=progress)
        except aot.KernelCompileError as e:
            raise DFlashError(f"{e} (nothing was written to {out_dir})") from None
        manifest = aot.load_manifest(path.parent)
        Console().print(
            manifest_table(
                manifest,
                f"{len(specs)} kernels x {len(archs)} archs compiled in "
                f"{time.perf_counter() - t0:.0f}s "
                f"(Triton {manifest['triton_version']})",
            )
        )
        click.echo(f"manifest: {path}")

    @kernels.command("list")
    @click.argument("folder", type=click.Path(file_okay=False))
    @friendly_errors
    def kernels_list(folder):
        """Print FOLDER/manifest.json (made by `kernels compile`) as a table; checks every sha256."""
        # deferred: rich takes ~0.1 s to import, and `dflash-trt --help` imports this module
        from rich.console import Console

        if not (Path(folder) / MANIFEST).is_file():
            raise DFlashError(f"{folder}: no {MANIFEST}; make one with `dflash-trt kernels compile --out {folder}`")
        try:
            manifest = load_manifest(folder)
        except (ValueError, OSError, KeyError) as e:  # sha256 mismatch, missing file, bad JSON
            msg = f"invalid JSON ({e})" if isinstance(e, json.JSONDecodeError) else str(e)
            raise DFlashError(f"{folder}: {msg}; recompile with `dflash-trt kernels compile --out {folder}`") from None
        title = (
            f"{folder}: {len(manifest['kernels'])} kernels, archs {', '.join(manifest['archs'])} "
            f"(Triton {manifest['triton_version']})"
        )
        Console().print(manifest_table(manifest, title))
