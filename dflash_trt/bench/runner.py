"""`run_bench(BenchConfig)`: the whole benchmark in one process, the library call behind
`dflash-trt bench` and `scripts/bench.py`.

Boundary: loading (target, tokenizer, drafter, assistant, server), prompt encoding, warm-up, and
the runs of every dataset through the interleaved schedule with its exactness check (schedule.py:
for every prompt, every method in turn, A B A B ...) and the sampling comparison; numbers are
aggregated and written by report.py / plots.py, the scaling sweeps live in scaling.py.

Exactness: at temperature 0 every lossless method's output must equal the reference (`hf`,
else `baseline`) token for token (text for the server); any difference fails the run with
OutputMismatchError naming method, prompt and first differing position, after the report is
written. At temperature > 0 outputs are compared as distributions (report.sample_divergence).
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from dflash_trt.api import (
    inexact_greedy_note,
    load_drafter,
    load_target,
    load_tokenizer,
    parse_dtype,
    resolve_device,
    resolve_target_dir,
    stop_ids,
)
from dflash_trt.bench import (
    llama_cpp,  # noqa: F401  (registers the llama-cpp method)
    report,
    scaling,
)
from dflash_trt.bench.datasets import load_dataset
from dflash_trt.bench.methods import METHODS, Item, MethodUnavailable, neutral_generation_config
from dflash_trt.bench.schedule import fit_prompt, run_schedule
from dflash_trt.config import SamplingParams, check_block_size
from dflash_trt.contention import CpuWatch, contention_warning
from dflash_trt.decoding.draft_length import check_cutoff, length_source
from dflash_trt.decoding.options import DEFAULT_PROPOSER
from dflash_trt.decoding.proposers import CHOICES
from dflash_trt.decoding.stopping import target_stop_ids
from dflash_trt.errors import ConfigError, DFlashError
from dflash_trt.modeling.cpu_pack import pack_hf_model
from dflash_trt.serving.repo import default_template_dir, default_values, fill_model_repo
from dflash_trt.serving.server import TritonServer

DEFAULT_METHODS = ("baseline", "hf", "hf-assisted", "hf-prompt-lookup", "dflash", "ngram", "hybrid", "dflash-triton")


class OutputMismatchError(DFlashError):
    """A lossless method's greedy output differs from the reference."""


@dataclass
class BenchConfig:
    target: str
    drafter: str | None = None  # DFlash checkpoint folder
    random_drafter: bool = False  # untrained drafter (pipeline check; no speedup)
    assistant: str | None = None  # hf-assisted draft model: known name or HF folder
    datasets: list[str] = field(default_factory=lambda: ["humaneval"])
    num_prompts: int = 8
    max_new_tokens: int = 128
    max_prompt_tokens: int | None = None  # truncate longer prompts (content tokens)
    chat: bool = True
    temperature: float = 0.0
    seed: int = 0
    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))
    block_size: int | None = None
    draft_cutoff: float = 0.0  # dflash: verify only the drafts the drafter is this sure of (decoding/draft_length.py)
    draft_length: str = "block"  # dflash: what draft_cutoff gates: block | confidence (a DSpark confidence head)
    proposer: str = DEFAULT_PROPOSER  # dflash-triton: the served engine's (in-process: methods ngram / hybrid)
    out_dir: str = "bench_out"
    dtype: str = "auto"
    device: str = "auto"
    warmup: int = 1
    prompt_lookup_tokens: int = 10
    max_matching_ngram: int = 2
    triton_url: str | None = None
    sweep_block_sizes: list[int] = field(default_factory=list)
    sweep_prompt_lengths: list[int] = field(default_factory=list)
    sweep_concurrency: list[int] = field(default_factory=list)
    plots: bool = True
    home: str | None = None  # dataset cache root (default $DFLASH_TRT_HOME)

    def __post_init__(self):
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise ConfigError(f"methods {unknown}: unknown; choose from {', '.join(METHODS)}")
        if not self.methods:
            raise ConfigError("methods: give at least one")
        if self.num_prompts < 1:
            raise ConfigError(f"num_prompts={self.num_prompts}: must be >= 1")
        if self.temperature < 0:
            raise ConfigError(f"temperature={self.temperature}: must be >= 0")
        for b in self.sweep_block_sizes + ([self.block_size] if self.block_size else []):
            check_block_size(b)
        length_source(self.draft_length, check_cutoff(self.draft_cutoff))
        if self.proposer not in CHOICES:  # the engine's values; it refuses the rest when it loads
            raise ConfigError(f"proposer={self.proposer!r}: choose one of {', '.join(CHOICES)}")


class BenchContext:
    """Models and options shared by the methods of one bench run."""

    def __init__(self, cfg: BenchConfig, progress: bool = True):
        self.cfg, self.chat = cfg, cfg.chat
        self.device = resolve_device(cfg.device)
        self.target, self.target_path = load_target(cfg.target, cfg.dtype, progress=progress, device=self.device)
        self.tokenizer = load_tokenizer(self.target_path)
        neutral_generation_config(self.target.hf, self.tokenizer)
        self.stop_ids = stop_ids(self.tokenizer)
        self.stops = set(self.stop_ids) | set(target_stop_ids(self.target))
        self.assistant = cfg.assistant
        self.prompt_lookup_tokens, self.max_matching_ngram = cfg.prompt_lookup_tokens, cfg.max_matching_ngram
        self.triton_url = cfg.triton_url
        self.max_seq_len = 2048
        self._drafters: dict = {}
        self._tmp = tempfile.TemporaryDirectory(prefix="dflash-bench-")

    def drafter(self, block_size: int | None = None):
        b = block_size or self.cfg.block_size
        if b not in self._drafters:
            if not self.cfg.drafter and not self.cfg.random_drafter:
                raise MethodUnavailable("no --drafter given (or --random-drafter for a pipeline check)")
            d = load_drafter(self.target, self.cfg.drafter, b, random_init=self.cfg.random_drafter, seed=self.cfg.seed)
            self._drafters[b] = d.to(self.device)
        return self._drafters[b]

    def load_assistant(self):
        # deferred: transformers takes ~0.6 s to import, and `dflash-trt --help` imports this module
        from transformers import AutoModelForCausalLM

        path = resolve_target_dir(self.assistant)
        dtype = parse_dtype(self.cfg.dtype, device=self.device)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(self.device).eval()
        if self.target.packed:  # the assistant runs on the same CPU GEMMs as the target
            pack_hf_model(model)
        tokenizer = load_tokenizer(path)
        neutral_generation_config(model, tokenizer)
        return model, tokenizer

    def start_server(self):
        """A TritonServer (entered) over a model repository for this run's target and drafter."""
        drafter_dir = self.cfg.drafter
        if not drafter_dir or self.cfg.block_size:  # a random drafter, or a block size override: save it
            drafter_dir = Path(self._tmp.name) / "drafter"
            self.drafter().save_pretrained(drafter_dir)
        values = default_values(
            self.target_path,
            drafter_dir,
            dtype=self.cfg.dtype,
            max_seq_len=self.max_seq_len,
            apply_chat_template=self.chat,
            max_batch=max([16] + self.cfg.sweep_concurrency),
            draft_cutoff=self.cfg.draft_cutoff,
            draft_length=self.cfg.draft_length,
            proposer=self.cfg.proposer,
        )
        repo = fill_model_repo(default_template_dir(), Path(self._tmp.name) / "repo", values)
        return TritonServer(repo, startup_timeout=600).__enter__()

    def close(self):
        self._tmp.cleanup()


# ---- prompts -------------------------------------------------------------------------------
def build_items(ctx: BenchContext, cfg: BenchConfig) -> dict[str, list[Item]]:
    items = {}
    for name in cfg.datasets:
        prompts = load_dataset(name, cfg.num_prompts, cfg.home)
        ds = []
        for p in prompts:
            text, ids = fit_prompt(ctx.tokenizer, p.for_mode(cfg.chat), cfg.chat, None)
            if cfg.max_prompt_tokens and len(ids) > cfg.max_prompt_tokens:
                text, ids = fit_prompt(ctx.tokenizer, text, cfg.chat, cfg.max_prompt_tokens)
            ds.append(Item(p.dataset, p.id, text, ids))
        items[prompts[0].dataset] = ds
    return items


# ---- running -------------------------------------------------------------------------------
def warm_up(methods: dict, items: list[Item], params: SamplingParams, ctx, rounds: int) -> None:
    if rounds < 1 or not items:
        return
    text, ids = fit_prompt(ctx.tokenizer, items[0].text, ctx.chat, min(len(items[0].ids), 48))
    short = Item("warmup", "0", text, ids)
    p = dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, 8))
    for _ in range(rounds):
        for m in methods.values():
            m.run(short, p)


def prepare_methods(ctx, names: list[str], say=print) -> tuple[dict, dict[str, str]]:
    methods, skipped = {}, {}
    for name in names:
        m = METHODS[name](ctx)
        try:
            m.prepare()
        except MethodUnavailable as e:
            skipped[name] = str(e)
            say(f"skipping {name}: {e}")
            continue
        methods[name] = m
    return methods, skipped


def run_bench(cfg: BenchConfig, say=print, progress: bool = True) -> dict:
    """Run the benchmark, write bench.json / bench.md / plots into cfg.out_dir, return the report.
    Raises OutputMismatchError (after writing) if a lossless method's greedy output differs."""
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ctx = BenchContext(cfg, progress=progress)
    methods: dict = {}
    mismatches: list[str] = []
    try:
        items = build_items(ctx, cfg)
        longest = max(len(i.ids) for ds in items.values() for i in ds)
        ctx.max_seq_len = min(
            ctx.target.max_context(), max(longest, *(cfg.sweep_prompt_lengths or [0])) + cfg.max_new_tokens + 64
        )
        params = SamplingParams(
            temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens, stop_token_ids=ctx.stop_ids, seed=cfg.seed
        )
        methods, skipped = prepare_methods(ctx, cfg.methods, say)
        if not methods:
            raise DFlashError(f"no method can run here: {skipped}")
        reference = "hf" if "hf" in methods else ("baseline" if "baseline" in methods else None)
        with _quiet_transformers():
            warm_up(methods, [i for ds in items.values() for i in ds], params, ctx, cfg.warmup)
            records = []
            with CpuWatch() as watch:
                for ds in items.values():
                    records += run_schedule(
                        methods,
                        ds,
                        params,
                        reference,
                        ctx,
                        mismatches,
                        say=say,
                        on_run=lambda r: say(_progress_line(r)) if progress else None,
                    )
            sampling = None if params.greedy else report.sample_divergence(ctx, records, reference)
            sweeps = scaling.run_sweeps(ctx, cfg, methods, items, params, records, mismatches, say)
        rep = report.build_report(
            cfg,
            ctx,
            records,
            list(methods),
            skipped,
            reference,
            mismatches,
            sampling,
            sweeps,
            lossless={n for n, m in methods.items() if m.lossless},
        )
        # the Triton server is another process: its work would read as contention, so no figure then
        rep["other_cpu_share"] = None if "dflash-triton" in methods else watch.others_share
        report.write_outputs(rep, out, plots=cfg.plots, say=say)
        if warn := contention_warning(rep["other_cpu_share"]):
            say(warn)
    finally:
        for m in methods.values():
            m.close()
        ctx.close()
    if mismatches:
        note = inexact_greedy_note(ctx.target.dtype)
        raise OutputMismatchError(
            f"{len(mismatches)} greedy output mismatch(es); first: {mismatches[0]} "
            f"(report in {out})" + (f"; {note}" if note else "")
        )
    return rep


def _progress_line(rec: dict) -> str:
    r = rec["run"]
    dt = r.wall - r.ttft
    tps = (r.num_output_tokens - 1) / dt if dt > 0 else 0.0
    flag = "  MISMATCH" if rec.get("mismatch") else ""
    return (
        f"  {rec['dataset']}/{rec['prompt']:<8} {rec['method']:<17} {r.num_output_tokens:4d} tok {tps:8.1f} tok/s{flag}"
    )


@contextlib.contextmanager
def _quiet_transformers():
    # deferred: transformers takes ~0.6 s to import, and `dflash-trt --help` imports this module
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
