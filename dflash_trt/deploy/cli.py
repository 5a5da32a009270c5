"""`dflash-trt build` (all stages) and `dflash-trt build <stage>`: thin shells over deploy/run.py.

Every BuildConfig field is a `--field` option (help text = the field's comment in deploy/build_config.py),
overriding the YAML file given with --config. Values pass through as text and are validated by
BuildConfig itself, so a bad value reads the same from YAML and from the command line.
"""

from __future__ import annotations

import dataclasses
import typing

import click

from dflash_trt.cli_shared import friendly_errors
from dflash_trt.config import field_help
from dflash_trt.deploy.build_config import BuildConfig, load_build_config
from dflash_trt.deploy.check import check, print_summary, resolve_inputs
from dflash_trt.deploy.run import STAGE_NAMES, run_build, stage_table
from dflash_trt.errors import DFlashError


def _field_options(fn):
    hints, helps = typing.get_type_hints(BuildConfig), field_help(BuildConfig)
    for f in reversed(dataclasses.fields(BuildConfig)):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else "[]"
        text = f"{helps.get(f.name, '')} [default: {default}]"
        if hints[f.name] is bool:
            fn = click.option(f"{flag}/--no-{f.name.replace('_', '-')}", f.name, default=None, help=text)(fn)
        else:
            fn = click.option(flag, f.name, default=None, metavar="VALUE", help=text)(fn)
    return fn


def _common(fn):
    fn = _field_options(fn)
    fn = click.option("--force", is_flag=True, help="Rebuild every stage, ignoring the previous build in --out.")(fn)
    fn = click.option("--out", "out", default=None, help="Output folder (built in a temp dir, renamed on success).")(fn)
    fn = click.option("--config", "config_path", default=None, help="build.yaml (fields of BuildConfig).")(fn)
    return fn


def _run(config_path, out, force, fields, only=None) -> None:
    # deferred: rich takes ~0.1 s to import, and `dflash-trt --help` imports this module
    from rich.console import Console
    from rich.table import Table

    cfg = load_build_config(config_path, fields)
    if out is None:
        if only == "check":  # a dry check: nothing written
            print_summary(check(cfg, resolve_inputs(cfg)))
            click.echo("check: ok")
            return
        raise DFlashError("--out DIR is required (the build folder to write)")
    manifest = run_build(cfg, out, force=force, only=only, echo=lambda m: click.echo(m, err=True))
    t = Table(title=f"dflash-trt build -> {out}")
    for col in ("stage", "status", "time"):
        t.add_column(col)
    for row in stage_table(manifest):
        t.add_row(*row)
    Console(stderr=True).print(t)
    click.echo(str(out))


def register(main: click.Group) -> None:
    @main.group("build", invoke_without_command=True, context_settings={"max_content_width": 110})
    @_common
    @click.pass_context
    @friendly_errors
    def build(ctx, config_path, out, force, **fields):
        """Build target + drafter into engines and a Triton model repository.

        Stages: check, quantize, engine, repo, emit, eval (see docs/deploy.md#build).
        Backends: torch (engine/ folders for dflash-trt's own engine + a Triton Python-backend model
        repository; CPU or CUDA, every drafter family) | trtllm-pytorch (model.yaml for TensorRT-LLM
        >= 1.3's PyTorch backend + a Triton llmapi model repository; GPU hosts). emit: vllm, sglang
        writes their serving commands and the drafter copy each loads.
        `dflash-trt build --config build.yaml --out DIR` runs them all; `dflash-trt build STAGE ...`
        runs one stage and the stages it needs. Unchanged stages of an earlier build in DIR are
        reused; --force rebuilds them.
        """
        if ctx.invoked_subcommand is None:
            _run(config_path, out, force, fields)

    docs = {
        "check": "Verify target, drafter and tokenizer fit; print params, memory and KV-cache size.",
        "quantize": "FP8 / NVFP4 checkpoints (Model Optimizer HF layout) with calibrated activation scales.",
        "engine": "torch: engine/ with target, drafter, tokenizer; trtllm-pytorch: engine/model.yaml + drafter.",
        "repo": "The filled Triton model repository.",
        "emit": "vLLM / SGLang serving commands and drafter copies (--emit vllm,sglang).",
        "eval": "tau and greedy agreement of the quantized pair against bf16 on held-out prompts.",
    }

    def make(stage: str):
        @_common
        @friendly_errors
        def cmd(config_path, out, force, **fields):
            _run(config_path, out, force, fields, only=stage)

        cmd.__doc__ = docs[stage] + " Runs the stages it depends on first (or reuses them from --out)."
        return build.command(stage)(cmd)

    for stage in STAGE_NAMES:
        make(stage)
