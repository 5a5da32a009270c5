"""`dflash-trt data generate`, `dflash-trt train`, `dflash-trt eval`: thin shells over train/*."""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path

import click

from dflash_trt.api import load_target, load_tokenizer, resolve_target_dir
from dflash_trt.cli_shared import (
    dtype_device_options,
    engine_options,
    friendly_errors,
    parse_floats,
    parse_ints,
)
from dflash_trt.config import field_help, load_yaml_dataclass
from dflash_trt.decoding.options import EngineOptions
from dflash_trt.errors import ConfigError, DFlashError
from dflash_trt.train import distributed
from dflash_trt.train.corpus import agreement, load_texts, score_corpus
from dflash_trt.train.data import generate_data, is_validation, mark_validation, read_sequences
from dflash_trt.train.evaluate import evaluate, print_eval
from dflash_trt.train.prompts import HELD_OUT, load_prompts
from dflash_trt.train.remote import Regenerator, ServerConfig, generate_remote
from dflash_trt.train.split_training import train_split
from dflash_trt.train.trainer import TrainConfig, train


def _options_from_dataclass(cls):
    """One --flag per dataclass field; help is the field's comment in the class body plus its default."""
    hints = typing.get_type_hints(cls)
    helps = field_help(cls)

    def deco(fn):
        for f in reversed(dataclasses.fields(cls)):
            t = hints[f.name]
            flag = "--" + f.name.replace("_", "-")
            shown = "auto" if f.default is None and t == (bool | None) else f.default
            text = (helps.get(f.name, "") + f" [default: {shown}]").strip()
            if t is bool or t == (bool | None):
                fn = click.option(f"{flag}/--no-{f.name.replace('_', '-')}", default=None, help=text)(fn)
            elif "list" in str(t):
                fn = click.option(flag, default=None, help=f"{text} (comma-separated ints)")(fn)
            else:
                base = {int: int, float: float}.get(t) or (
                    int if "int" in str(t) else float if "float" in str(t) else str
                )
                fn = click.option(flag, type=base, default=None, help=text)(fn)
        return fn

    return deco


# the options both `data` commands take: they run the target in training precision
_target_option = click.option("--target", required=True, help="Target model name or folder.")
_DATA_DTYPE_HELP = "auto: bf16 on GPUs and on CPUs with native bf16 GEMMs (AVX512-BF16/AMX), else fp32"


@click.group()
def data():
    """Training data: the target regenerates answers to prompts (generate) or scores existing text (score)."""


def _check_data_destination(source: str, out: str, validation: bool) -> None:
    """Training data never comes from the held-out benchmark prompts, and never lands in a validation set."""
    if source in HELD_OUT and not validation:
        raise DFlashError(
            f"--prompts {source}: benchmark prompts are held out from training (they measure "
            f"the drafter); use stdlib, stdlib-code or your own prompt file, or add --validation to make "
            f"a validation set for `train --val-data`"
        )
    if not validation and is_validation(out):
        raise DFlashError(f"--out {out}: holds a validation set; add --validation to extend it, or pick another folder")


@data.command("generate")
@click.option(
    "--target",
    default=None,
    help="Target model name or folder (required without --server; with it, only its tokenizer is read, "
    "for --retokenize).",
)
@click.option(
    "--prompts",
    "source",
    required=True,
    help="stdlib | stdlib-code | FILE.txt | FILE.jsonl; with --validation also humaneval | writingbench",
)
@click.option("--out", required=True, help="Output folder of data-*.jsonl shards.")
@click.option(
    "--validation",
    is_flag=True,
    default=False,
    help="A held-out validation set for `train --val-data` (marked: never accepted as training data).",
)
@click.option("--limit", type=int, default=None, help="Use at most this many prompts.")
@click.option("--max-new-tokens", type=int, default=256, show_default=True)
@click.option("--batch-size", type=int, default=8, show_default=True)
@click.option("--chat/--no-chat", default=True, show_default=True)
@dtype_device_options(_DATA_DTYPE_HELP)
@click.option(
    "--server",
    default=None,
    help="An OpenAI-compatible server of the target (vLLM, SGLang, trtllm-serve, dflash-trt serve "
    "--openai-port), e.g. http://127.0.0.1:8000/v1: it answers instead of an in-process target. It must "
    "return token ids (return_token_ids); --chat sends chat messages, so its own chat template applies.",
)
@click.option("--server-model", default=None, help="The served model name (default: the one /v1/models lists).")
@click.option(
    "--api-key",
    envvar="OPENAI_API_KEY",
    default=None,
    help="--server: the key it requires (sent as 'Authorization: Bearer <key>'); or set $OPENAI_API_KEY.",
)
@click.option("--concurrency", type=int, default=8, show_default=True, help="--server: requests in flight.")
@click.option("--retries", type=int, default=5, show_default=True, help="--server: retries of a failed request.")
@click.option("--timeout", type=float, default=600.0, show_default=True, help="--server: seconds per request.")
@click.option(
    "--retokenize",
    is_flag=True,
    default=False,
    help="--server without token ids: re-encode its text with --target's tokenizer (approximate ids).",
)
@friendly_errors
def data_generate(
    target,
    source,
    out,
    limit,
    max_new_tokens,
    batch_size,
    chat,
    dtype,
    device,
    validation,
    server,
    server_model,
    api_key,
    concurrency,
    retries,
    timeout,
    retokenize,
):
    """The target answers every prompt (in-process, or through --server); resumable: run the same
    command again after an interruption and finished shards are kept."""
    _check_data_destination(source, out, validation)
    if not server and not target:
        raise DFlashError("--target: required (or --server URL to regenerate through a serving engine)")
    prompts = load_prompts(source, limit)
    if server:
        cfg = ServerConfig(
            server,
            server_model,
            chat,
            max_new_tokens,
            concurrency=concurrency,
            retries=retries,
            timeout=timeout,
            retokenize=retokenize,
            api_key=api_key,
        )
        tok = load_tokenizer(resolve_target_dir(target)) if target else None
        regen = Regenerator(cfg, tok)  # checks the server and the model name before any shard
    else:
        tgt, path = load_target(target, dtype, for_training=True, device=device)
    if validation:  # marked before any shard exists, so an interrupted run is never mistaken for training data
        Path(out).mkdir(parents=True, exist_ok=True)
        mark_validation(out, source)
    if server:
        click.echo(generate_remote(regen, prompts, out))
    else:
        click.echo(generate_data(tgt, load_tokenizer(path), prompts, out, max_new_tokens, batch_size, chat))


@data.command("score")
@_target_option
@click.option(
    "--text",
    "source",
    required=True,
    help="stdlib-src (the Python standard library's source) | FILE (.py/.txt/.md/.rst) | FILE.jsonl "
    '({"text": ...} per line) | FOLDER (its text files)',
)
@click.option("--out", required=True, help="Output folder of data-*.jsonl shards (for `train --data`).")
@click.option("--seq-len", type=int, default=512, show_default=True, help="Tokens per sequence (text window).")
@click.option("--limit", type=int, default=None, help="Use at most this many windows.")
@click.option("--batch-size", type=int, default=4, show_default=True)
@dtype_device_options(_DATA_DTYPE_HELP)
@friendly_errors
def data_score(target, source, out, seq_len, limit, batch_size, dtype, device):
    """Teacher-forced data: the target scores existing text once (its greedy next token at every
    position becomes the label); about 5x the tokens per CPU minute of regenerating answers."""
    texts = load_texts(source)
    tgt, path = load_target(target, dtype, for_training=True, device=device)
    folder = score_corpus(tgt, load_tokenizer(path), texts, out, seq_len, limit, batch_size)
    seqs = read_sequences(folder)
    click.echo(
        f"{folder}: {len(seqs)} sequences, {sum(len(s['input_ids']) for s in seqs)} tokens; the text "
        f"agrees with the target's greedy prediction at {agreement(seqs):.0%} of tokens"
    )


@click.command("train")
@click.option("--config", "config_path", default=None, help="YAML file mirroring TrainConfig.")
@click.option(
    "--split-target",
    is_flag=True,
    default=False,
    help="Under torchrun: the target's layers split into one pipeline stage per rank (targets larger than "
    "one device); the ranks still train the drafter data-parallel.",
)
@_options_from_dataclass(TrainConfig)
@friendly_errors
def train_cmd(config_path, split_target, **overrides):
    """Train a drafter of any family (resumes from OUT/checkpoint); writes OUT/drafter. Under torchrun
    (`torchrun --nproc_per_node N -m dflash_trt.cli train ...`) the ranks split every batch."""
    if overrides.get("target_layer_ids"):
        overrides["target_layer_ids"] = parse_ints(overrides["target_layer_ids"], "--target-layer-ids")
    if overrides.get("family_fields"):
        try:
            overrides["family_fields"] = json.loads(overrides["family_fields"])
        except json.JSONDecodeError as e:
            raise ConfigError(f"--family-fields: not JSON ({e.msg}); e.g. '{{\"markov_rank\": 64}}'") from None
    if config_path:
        cfg = load_yaml_dataclass(TrainConfig, config_path, overrides)
    else:
        cfg = TrainConfig(**{k: v for k, v in overrides.items() if v is not None})
    try:
        final = train_split(cfg) if split_target else train(cfg)
        if distributed.rank() == 0:  # torchrun: one line, not one per rank
            click.echo(final)
    finally:
        distributed.shutdown()  # torchrun: leave the process group


@click.command("eval")
@click.option("--target", required=True)
@click.option("--drafter", "drafter_dir", required=True)
@click.option(
    "--prompts",
    "source",
    required=True,
    help="humaneval | writingbench (held-out benchmark sets), stdlib | stdlib-code (training "
    "prompts, to compare), FILE.txt | FILE.jsonl",
)
@click.option("--limit", type=int, default=8, show_default=True)
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--chat/--no-chat", default=True, show_default=True)
@dtype_device_options("auto: fp32 on CPU (greedy output must equal the baseline's), bf16 on GPU")
@click.option(
    "--block-size",
    "block_sizes",
    default=None,
    help="Comma-separated block sizes to run, e.g. 4,8,16 (default: the drafter's own; at most it).",
)
@click.option(
    "--draft-cutoff",
    "draft_cutoffs",
    default=None,
    help="Comma-separated draft cutoffs to run, e.g. 0,0.1: verify only the leading drafts whose "
    "running product of drafter probabilities is at least this (default 0: every draft).",
)
@engine_options(EngineOptions.cli_flags(), only=("draft_length", "proposer"))
@click.option("--json-out", default=None, help="Also write the results as JSON here.")
@friendly_errors
def eval_cmd(
    target,
    drafter_dir,
    source,
    limit,
    max_new_tokens,
    chat,
    dtype,
    device,
    block_sizes,
    draft_cutoffs,
    draft_length,
    proposer,
    json_out,
):
    """Real DFlash generation on held-out prompts: tau, per-position acceptance, speedup."""
    res = evaluate(
        target,
        drafter_dir,
        source,
        limit,
        max_new_tokens,
        chat,
        dtype,
        device=device,
        block_sizes=parse_ints(block_sizes, "--block-size") or None,
        draft_cutoffs=parse_floats(draft_cutoffs, "--draft-cutoff") or None,
        draft_length=draft_length,
        proposer=proposer,
    )
    print_eval(res)
    if json_out:
        with open(json_out, "w") as f:
            json.dump(res, f, indent=2)


def register(main: click.Group) -> None:
    main.add_command(data)
    main.add_command(train_cmd)
    main.add_command(eval_cmd)
