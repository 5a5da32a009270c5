"""`dflash-trt quickstart`: a real model, a real drafter, a measured speedup, on a fresh machine.

Boundary: orchestration of existing stages with cached artifacts under DFLASH_TRT_HOME:
  1. fetch the target (hub/models.py) - once;
  2. obtain a drafter: the cached quickstart drafter, or make one with the training recipe
     (target regenerates answers to standard-library prompts, offline features, short training);
  3. answer a prompt with DFlash and with the plain autoregressive loop, same engine and dtype,
     interleaved, and print the answer, tau and the speedup. The drafter's own speedup: proposer dflash
     (explicit, whatever the default: copied drafts would hide what the drafter does).
The second run skips 1 and 2 and takes seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import click

from dflash_trt.api import dtype_name, encode, load_drafter, load_target, load_tokenizer, set_block_size, stop_ids
from dflash_trt.config import SamplingParams, check_block_size
from dflash_trt.contention import CpuWatch, contention_warning
from dflash_trt.decoding.loop import generate, generate_baseline
from dflash_trt.decoding.options import EngineOptions
from dflash_trt.decoding.stats import DecodeStats
from dflash_trt.hub.drafters import bundled_drafter_for
from dflash_trt.hub.models import models_home
from dflash_trt.train.data import generate_data
from dflash_trt.train.prompts import stdlib_prompts
from dflash_trt.train.trainer import TrainConfig, train


@dataclass
class QuickstartConfig:
    target: str = "smollm2-135m-instruct"  # model name or folder
    prompt: str = "Write a Python function that returns the n-th Fibonacci number, with a docstring."
    num_prompts: int = 64  # training prompts (standard-library docstrings)
    response_tokens: int = 96  # tokens the target writes per training prompt
    block_size: int = 8  # the drafter's trained block size (which bundled drafter; the recipe's)
    run_block_size: int | None = None  # block run at generation (<= block_size); default 4 on a CPU, else block_size
    num_layers: int = 1
    epochs: int = 2
    max_new_tokens: int = 128
    repeats: int = 2  # interleaved DFlash/baseline runs for the timing
    retrain: bool = False  # ignore the bundled drafter and run the training recipe here

    def __post_init__(self):
        if self.run_block_size is not None:
            check_block_size(self.run_block_size, "run_block_size")  # 4 is the CPU default


def quickstart_drafter_dir(cfg: QuickstartConfig) -> Path:
    name = Path(cfg.target).name
    return models_home() / "drafters" / f"{name}-b{cfg.block_size}-l{cfg.num_layers}-quickstart"


def obtain_drafter(cfg: QuickstartConfig, target, tokenizer) -> tuple[Path, str]:
    """-> (drafter folder, where it came from): the drafter bundled for this target, else the one
    trained by an earlier quickstart, else one trained now (resumable at every stage).
    cfg.retrain skips the bundled one, to reproduce the recipe from scratch on this machine."""
    bundled = None if cfg.retrain else bundled_drafter_for(cfg.target, cfg.block_size)
    if bundled is not None:
        return (
            bundled.path,
            f"bundled drafter {bundled.name} (trained here by dflash-trt train; "
            f"recipe in {bundled.path / 'recipe.json'})",
        )
    work = quickstart_drafter_dir(cfg)
    final = work / "drafter"
    if (final / "model.safetensors").is_file():
        return final, f"drafter trained by an earlier quickstart ({final})"
    click.secho(
        f"No bundled drafter for {cfg.target}: training one (a few minutes on 2 CPU cores; a drafter this small "
        f"and this briefly trained accepts little, see docs/performance.md#quickstart-smollm2-135m; cached in "
        f"{work}).",
        fg="yellow",
        err=True,
    )
    generate_data(
        target,
        tokenizer,
        stdlib_prompts(cfg.num_prompts),
        work / "data",
        max_new_tokens=cfg.response_tokens,
        batch_size=16,
    )
    tc = TrainConfig(
        data=str(work / "data"),
        out=str(work),
        num_layers=cfg.num_layers,
        block_size=cfg.block_size,
        epochs=cfg.epochs,
        batch_size=4,
        anchors_per_seq=8,
        lr=1e-3,
        features="offline",
    )
    return train(tc, target=target), f"drafter trained just now ({final})"


def run_quickstart(cfg: QuickstartConfig) -> dict:
    target, path = load_target(cfg.target, "auto")
    tok = load_tokenizer(path)
    drafter_dir, source = obtain_drafter(cfg, target, tok)
    drafter = load_drafter(target, str(drafter_dir))
    # fewer MASK slots than trained: with packed CPU weights the bundled B=8 drafter ran faster at block 4
    # than at 8 on the quickstart prompt (docs/performance.md#cpu-speed-prepacked-weights)
    run_b = cfg.run_block_size or (4 if target.device.type == "cpu" else drafter.block_size)
    set_block_size(drafter, min(run_b, drafter.block_size))
    ids = encode(tok, cfg.prompt, chat=True)
    params = SamplingParams(max_new_tokens=cfg.max_new_tokens, stop_token_ids=stop_ids(tok))
    dflash = EngineOptions(proposer="dflash")
    generate(target, drafter, [ids], SamplingParams(max_new_tokens=4), options=dflash)  # warm-up
    spec, base = DecodeStats(), DecodeStats()
    with CpuWatch() as watch:
        for _ in range(cfg.repeats):  # interleaved A B A B: both see the same machine state
            a = generate(target, drafter, [ids], params, options=dflash)
            b = generate_baseline(target, [ids], params)
            spec.merge(a.stats)
            base.merge(b.stats)
    return {
        "answer": tok.decode(a.tokens[0], skip_special_tokens=True),
        "identical": a.tokens == b.tokens,
        "tau": spec.tau,
        "block_size": drafter.block_size,
        "dflash_tok_s": spec.decode_tokens_per_s,
        "baseline_tok_s": base.decode_tokens_per_s,
        "dtype": dtype_name(target.dtype),
        "speedup": spec.decode_tokens_per_s / base.decode_tokens_per_s if base.decode_tokens_per_s else 0.0,
        "per_position_acceptance": spec.per_position_acceptance,
        "drafter": source,
        "other_cpu_share": watch.others_share,
    }


def print_quickstart(res: dict, cfg: QuickstartConfig) -> None:
    # deferred: rich takes ~0.1 s to import, and `dflash-trt --help` imports this module
    from rich.console import Console
    from rich.table import Table

    con = Console()
    con.rule(f"[bold]{cfg.target}[/bold] + DFlash drafter")
    con.print(f"[bold]Drafter:[/bold] {res['drafter']}")
    con.print(f"[bold]Prompt:[/bold] {cfg.prompt}\n")
    con.print(res["answer"], markup=False, highlight=False)
    t = Table(title=f"DFlash vs autoregressive decoding (same engine, {res['dtype']}, greedy)")
    for col in ("acceptance length tau", "DFlash tok/s", "baseline tok/s", "speedup", "identical output"):
        t.add_column(col, justify="right")
    t.add_row(
        f"{res['tau']:.2f} / {res['block_size']}",
        f"{res['dflash_tok_s']:.1f}",
        f"{res['baseline_tok_s']:.1f}",
        f"{res['speedup']:.2f}x",
        "yes" if res["identical"] else "NO",
    )
    con.print(t)
    if warn := contention_warning(res.get("other_cpu_share")):
        con.print(warn, style="bold yellow", markup=False, highlight=False)
