"""`dflash-trt bench`: a thin click shell over `runner.run_bench(BenchConfig)`.

Boundary: option parsing only; `scripts/bench.py` runs this same command object. Exit codes:
0 success, 2 for user errors and for a greedy output mismatch (friendly_errors prints one line
naming the method and the prompt).
"""

from __future__ import annotations

import click
import torch

from dflash_trt.bench.runner import DEFAULT_METHODS, BenchConfig, run_bench
from dflash_trt.cli_shared import (
    dtype_device_options,
    engine_options,
    friendly_errors,
    parse_ints,
)
from dflash_trt.decoding.options import EngineOptions


def _names(value: str) -> list[str]:
    return [v for v in value.replace(" ", "").split(",") if v]


@click.command("bench")
@click.option("--target", required=True, help="Target model: a known name (`models list`) or a HF folder.")
@click.option("--drafter", "drafter", default=None, help="DFlash drafter checkpoint folder or bundled drafter name.")
@click.option("--random-drafter", is_flag=True, help="Untrained drafter: checks the pipeline (no speedup).")
@click.option(
    "--assistant",
    default=None,
    help="Draft model for hf-assisted (name or HF folder), e.g. qwen2.5-coder-0.5b-instruct.",
)
@click.option(
    "--dataset",
    "datasets",
    multiple=True,
    default=("humaneval",),
    show_default=True,
    help="humaneval | writingbench | varied (24 built-in prompts, no download) | heldout (20 built-in: code "
    "edits, math, chat, summaries) | a jsonl file of "
    '{"prompt": ...} lines (repeatable).',
)
@click.option("-n", "--num-prompts", default=8, show_default=True, type=int, help="Prompts per dataset.")
@click.option("--max-new-tokens", default=128, show_default=True, type=int)
@click.option("--max-prompt-tokens", default=None, type=int, help="Cut longer prompts to this many tokens.")
@click.option("--chat/--no-chat", default=True, show_default=True, help="Apply the tokenizer's chat template.")
@click.option(
    "--temperature",
    default=0.0,
    show_default=True,
    type=float,
    help="0: greedy, outputs must match hf exactly; >0: sampled, compared as distributions.",
)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option(
    "--methods",
    default=",".join(DEFAULT_METHODS),
    show_default=True,
    help="Comma-separated. dflash / ngram / hybrid / tree: our engine with that proposer (see --proposer).",
)
@click.option("--block-size", default=None, type=int, help="Override the drafter's block size.")
@engine_options(EngineOptions.cli_flags(), only=("draft_cutoff",), help_prefix="dflash: ")
@engine_options(EngineOptions.cli_flags(), only=("draft_length",), help_prefix="dflash, hybrid, dflash-triton: ")
@engine_options(
    EngineOptions.cli_flags(),
    only=("proposer",),
    help_prefix="dflash-triton (the served engine's; in-process, the methods dflash, ngram, hybrid, tree): ",
)
@click.option("--out", "out_dir", default="bench_out", show_default=True, help="Output folder.")
@dtype_device_options("auto (fp32 CPU, bf16 GPU) | bfloat16 | float32")
@click.option("--warmup", default=1, show_default=True, type=int, help="Warm-up rounds (all methods) before timing.")
@click.option(
    "--prompt-lookup-tokens",
    default=10,
    show_default=True,
    type=int,
    help="hf-prompt-lookup: prompt_lookup_num_tokens.",
)
@click.option("--triton-url", default=None, help="Use a running server (host:grpc_port) instead of starting one.")
@click.option("--sweep-block-sizes", default=None, help="Scaling: DFlash at these block sizes, e.g. 4,8,16.")
@click.option(
    "--sweep-prompt-lengths",
    default=None,
    help="Scaling: prompts cut/padded to these token lengths, " "e.g. 128,512,1024,2048,4096.",
)
@click.option("--sweep-concurrency", default=None, help="Scaling: concurrent server streams, e.g. 1,4,16.")
@click.option("--plots/--no-plots", default=True, show_default=True, help="PNG plots (needs matplotlib).")
@click.option("--threads", default=None, type=int, help="torch intra-op threads (default: torch's).")
@click.option("--quiet", is_flag=True, help="No per-prompt progress lines.")
@friendly_errors
def bench(threads, quiet, datasets, methods, sweep_block_sizes, sweep_prompt_lengths, sweep_concurrency, **fields):
    """Benchmark DFlash against the target alone (ours and HF generate), HF assisted generation and
    HF prompt lookup decoding on the same prompts, interleaved per prompt; checks exactness.

    Writes OUT/bench.json, OUT/bench.md and PNG plots; prints the table. Exits non-zero if any
    lossless method's greedy output differs from hf's."""
    if threads:
        torch.set_num_threads(threads)
    cfg = BenchConfig(
        datasets=list(datasets),
        methods=_names(methods),
        sweep_block_sizes=parse_ints(sweep_block_sizes, "--sweep-block-sizes"),
        sweep_prompt_lengths=parse_ints(sweep_prompt_lengths, "--sweep-prompt-lengths"),
        sweep_concurrency=parse_ints(sweep_concurrency, "--sweep-concurrency"),
        **fields,  # every other option is the BenchConfig field of its name, as given
    )
    run_bench(cfg, say=lambda msg: click.echo(msg, err=True), progress=not quiet)


def register(main: click.Group) -> None:
    main.add_command(bench)
