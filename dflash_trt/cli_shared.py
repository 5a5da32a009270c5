"""What every `dflash-trt` subcommand shares: the one-line error wrapper, the comma-separated list
options, and the options (and help texts of options) that several commands take.

Boundary: click glue only, no library imports. The top-level command (cli.py) and the subcommand
modules it registers (train/cli.py, deploy/cli.py, ...) both import this module; it imports
neither, so a subcommand module imports cleanly on its own.

Errors the user can act on (DFlashError) print one line and exit 2, never a traceback.
"""

from __future__ import annotations

import functools
import sys

import click

from dflash_trt.errors import ConfigError, DFlashError

DEVICE_HELP = "auto (the CUDA GPU where PyTorch sees one, else the CPU) | cpu | cuda | cuda:N"


def choice_option(name: str, choices, help_text: str, help_prefix: str = ""):
    """--<name> over `choices` from the caller (the library's one home of the values and their
    validation; this module imports no library code), the first value the default."""
    return click.option(
        "--" + name.replace("_", "-"),
        name,
        type=click.Choice(list(choices)),
        default=choices[0],
        show_default=True,
        help=help_prefix + help_text,
    )


def engine_options(fields, only=None, help_prefix: str = ""):
    """One --flag per EngineOptions field (decoding/options.py EngineOptions.cli_flags(): name, default,
    choices, help), so that the flags, their defaults and their help are the fields'; only: the field
    names to offer (default: all). The command receives each as a keyword of the field's name."""
    decorators = []
    for name, default, choices, help_text in fields:
        if only is not None and name not in only:
            continue
        kind = click.Choice(list(choices)) if choices else type(default)
        flag = "--" + name.replace("_", "-")
        decorators.append(
            click.option(flag, name, type=kind, default=default, show_default=True, help=help_prefix + help_text)
        )
    return stack(*decorators)


def flag_error(e: DFlashError, fields) -> DFlashError:
    """e with its leading `field=` (an options dataclass's one-line refusal) named as the command's flag
    (`--field-name=`), so the line names what the user typed; fields: as engine_options takes them."""
    name, sep, rest = str(e).partition("=")
    if not sep or name not in {f[0] for f in fields}:
        return e
    return type(e)("--" + name.replace("_", "-") + "=" + rest)


def stack(*decorators):
    """Several decorators as one, applied as if written one above the other in this order (so click
    lists the options in it)."""

    def apply(fn):
        for d in reversed(decorators):
            fn = d(fn)
        return fn

    return apply


def dtype_device_options(dtype_help: str):
    """--dtype (default auto; dtype_help says what auto picks in this command) then --device: the pair
    every command that loads a model takes."""
    return stack(
        click.option("--dtype", default="auto", show_default=True, help=dtype_help),
        click.option("--device", default="auto", show_default=True, help=DEVICE_HELP),
    )


def friendly_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except DFlashError as e:
            click.secho(f"error: {e}", fg="red", err=True)
            sys.exit(2)

    return wrapper


def parse_ints(value: str | None, flag: str) -> list[int]:
    """A comma-separated integer option ("4,8,16") -> [4, 8, 16]; [] when not given."""
    return _parse_list(value, flag, int, "integers, e.g. 4,8,16")


def parse_floats(value: str | None, flag: str) -> list[float]:
    """A comma-separated number option ("0,0.1") -> [0.0, 0.1]; [] when not given."""
    return _parse_list(value, flag, float, "numbers, e.g. 0,0.1,0.3")


def _parse_list(value, flag, kind, example):
    if not value:
        return []
    try:
        return [kind(v) for v in value.replace(" ", "").split(",") if v]
    except ValueError:
        raise ConfigError(f"{flag} {value!r}: expected comma-separated {example}") from None
