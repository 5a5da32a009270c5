"""The benchmarked decoding methods, behind one interface: `Method.run(item, params) -> Run`.

Boundary: one generation of one prompt per call, timed, plus what each method can tell about
its speculation. No aggregation, no output files (report.py), no scheduling (runner.py).

  baseline          target alone, our engine's `generate_baseline`
  hf                the same target's Hugging Face `generate()` (greedy, or sampling at T > 0)
  hf-assisted       HF assisted generation, `generate(assistant_model=...)`: a classic draft model
                    (another vocabulary: HF universal assisted decoding, tokenizer + assistant_tokenizer)
  hf-prompt-lookup  HF prompt lookup decoding, `generate(prompt_lookup_num_tokens=...)`
  dflash            our DFlash speculative decoding in-process (`spec.loop.generate`)
  ngram             our engine, drafts copied from the row's own text (proposer=ngram; drafter not run)
  hybrid            our engine, per row and round the copy or the drafter's block (proposer=hybrid)
  tree              our engine, the copy and the drafter's block verified together in one pass (proposer=tree)
  dflash-triton     ours through a Triton server over gRPC (`serving.client.DFlashClient`)

Every method reports the same `Run`: output tokens (or text for the server), time to first
token, wall time, and `accept_hist[k]` = decode passes of the target (after the pass that
produced the first token) that emitted k tokens, from which tau and per-position acceptance
follow for all methods alike. For HF methods the passes are seen through a streamer (one
`put` per target pass) and timed with forward hooks on the target and the assistant. Ours with
a drafter that has a confidence head (DSpark) also report `predicted_at`, its summed predicted
per-position acceptance (decoding/stats.py), for the predicted-vs-actual comparison, and all of ours
`sources` (decoding/stats.py DecodeStats.sources): steps, drafts and accepted drafts per draft source
(the drafter, or copied from the row's own text).
`METHODS` is a registry: tests add a deliberately wrong method to it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dflash_trt.bench.clocks import ForwardTimer, PassClock
from dflash_trt.bench.clocks import sync as _sync
from dflash_trt.config import SamplingParams
from dflash_trt.decoding.loop import generate, generate_baseline
from dflash_trt.decoding.session import Session
from dflash_trt.errors import DFlashError
from dflash_trt.serving.client import DFlashClient


class MethodUnavailable(Exception):
    """The method cannot run here (missing option or package); the bench skips it with this reason."""


@dataclass
class Item:
    """One prompt as every method sees it: token ids (in-process) and text (the server)."""

    dataset: str
    id: str
    text: str
    ids: list[int]

    @property
    def key(self) -> str:
        return f"{self.dataset}/{self.id}"


@dataclass
class Run:
    tokens: list[int] | None  # generated ids (None: the method returns text only)
    num_output_tokens: int
    ttft: float  # seconds from the call to the first generated token
    wall: float  # seconds for the whole call
    accept_hist: list[int] = field(default_factory=list)  # [k] = decode passes that emitted k tokens
    draft_time: float = 0.0  # seconds drafting over the decode passes
    verify_time: float = 0.0  # seconds in target passes after the first
    text: str | None = None
    drafts_verified: int | None = None  # draft tokens the target judged (ours; less than passes x (B-1) when gated)
    predicted_at: list[float] | None = None  # ours, drafters with a confidence head: decoding/stats.py predicted_at
    sources: dict | None = None  # ours: {"drafter"|"copied": {steps, drafts, accepted}} (decoding/stats.py)

    @property
    def num_steps(self) -> int:
        return sum(self.accept_hist)


def hist_of(sizes) -> list[int]:
    sizes = list(sizes)
    h = [0] * (max(sizes, default=1) + 1)
    for s in sizes:
        h[s] += 1
    return h


class Method:
    name = ""
    lossless = True  # greedy output must equal the reference token for token

    def __init__(self, ctx):
        self.ctx = ctx

    def prepare(self) -> None:
        """Load what the method needs; raise MethodUnavailable to be skipped."""

    def run(self, item: Item, params: SamplingParams) -> Run:
        raise NotImplementedError

    def close(self) -> None:
        pass


METHODS: dict[str, type[Method]] = {}


def register(cls: type[Method]) -> type[Method]:
    METHODS[cls.name] = cls
    return cls


# ---- our engine ------------------------------------------------------------------------------
@register
class Baseline(Method):
    name = "baseline"

    def run(self, item, params):
        t0 = time.perf_counter()
        res = generate_baseline(self.ctx.target, [item.ids], params)
        _sync(self.ctx.device)
        wall = time.perf_counter() - t0
        toks = res.tokens[0]
        return Run(toks, len(toks), res.stats.prefill_time, wall, [0, len(toks) - 1], verify_time=res.stats.verify_time)


@register
class DFlash(Method):
    name = "dflash"
    proposer = "dflash"  # where the drafts come from: decoding/engine.py PROPOSERS
    block_size: int | None = None  # None: the context's (the drafter's own, or --block-size)

    def prepare(self):
        self.drafter = self.ctx.drafter(self.block_size)
        # what the engine learns (the drafter's record, the verify cost curve) carries over this method's
        # prompts, as it would over a server's requests (decoding/session.py); the warm-up round fills it
        self.session = Session()

    def draft_options(self) -> dict:
        cfg = self.ctx.cfg
        return dict(draft_cutoff=cfg.draft_cutoff, draft_length=cfg.draft_length)

    def run(self, item, params):
        t0 = time.perf_counter()
        res = generate(
            self.ctx.target,
            self.drafter,
            [item.ids],
            params,
            proposer=self.proposer,
            session=self.session,
            **self.draft_options(),
        )
        _sync(self.ctx.device)
        wall = time.perf_counter() - t0
        s, toks = res.stats, res.tokens[0]
        return Run(
            toks,
            len(toks),
            s.prefill_time,
            wall,
            list(s.accept_hist),
            s.draft_time,
            s.verify_time,
            drafts_verified=s.num_draft_tokens,
            predicted_at=list(s.predicted_at) or None,
            sources=s.sources,
        )


@register
class NGram(DFlash):
    """Our engine with every draft copied from the row's own text; the drafter (loaded as for dflash) is
    never run, so --draft-cutoff / --draft-length, which gate the drafter's drafts, do not apply."""

    name = "ngram"
    proposer = "ngram"

    def draft_options(self) -> dict:
        return {}


@register
class Hybrid(DFlash):
    """Our engine choosing, per row and round, the copied continuation or the drafter's block."""

    name = "hybrid"
    proposer = "hybrid"


@register
class Tree(DFlash):
    """Our engine verifying the copied continuation and the drafter's block in one tree-masked target pass."""

    name = "tree"
    proposer = "tree"


# ---- Hugging Face generate() -----------------------------------------------------------------
def neutral_generation_config(model, tokenizer) -> None:
    """Replace a model's generation defaults (repetition penalty, sampling knobs from the Hub) by
    plain ones, so `generate()` does exactly what our engine does for the same SamplingParams."""
    # deferred: transformers takes ~0.6 s to import, and `dflash-trt --help` imports this module
    from transformers import GenerationConfig

    old = model.generation_config
    model.generation_config = GenerationConfig(
        bos_token_id=old.bos_token_id,
        eos_token_id=old.eos_token_id,
        pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
    )


def hf_run(ctx, item: Item, params: SamplingParams, assistant=None, **extra) -> Run:
    model = ctx.target.hf
    ids = torch.tensor([item.ids], device=ctx.device)
    kw = dict(
        max_new_tokens=params.max_new_tokens,
        do_sample=not params.greedy,
        eos_token_id=sorted(ctx.stops) or None,
        pad_token_id=model.generation_config.pad_token_id,
        attention_mask=torch.ones_like(ids),
    )
    if not params.greedy:
        kw.update(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
        if params.seed is not None:
            torch.manual_seed(params.seed)
    if assistant is not None:
        kw["assistant_model"] = assistant
    clock = PassClock()
    with torch.no_grad(), ForwardTimer(model, ctx.device) as tgt, ForwardTimer(assistant, ctx.device) as asst:
        t0 = time.perf_counter()
        out = model.generate(ids, streamer=clock, **kw, **extra)
        _sync(ctx.device)
        wall = time.perf_counter() - t0
    toks = out[0, ids.shape[1] :].tolist()
    passes = clock.events[1:]  # events[0] is the prompt
    first_end = tgt.calls[0][1] if tgt.calls else t0
    return Run(
        toks,
        len(toks),
        passes[0][0] - t0 if passes else wall,
        wall,
        hist_of(n for _, n in passes[1:]),
        draft_time=sum(e - s for s, e in asst.calls if s >= first_end),
        verify_time=sum(e - s for s, e in tgt.calls[1:]),
    )


@register
class HF(Method):
    name = "hf"

    def run(self, item, params):
        return hf_run(self.ctx, item, params)


@register
class HFAssisted(Method):
    name = "hf-assisted"

    def prepare(self):
        if not self.ctx.assistant:
            raise MethodUnavailable("no --assistant model given")
        self.assistant, asst_tokenizer = self.ctx.load_assistant()
        self.extra = {}
        if self.assistant.config.get_text_config().vocab_size != self.ctx.target.hf.config.get_text_config().vocab_size:
            # universal assisted decoding: HF re-tokenizes between the two vocabularies
            self.extra = {"tokenizer": self.ctx.tokenizer, "assistant_tokenizer": asst_tokenizer}

    def run(self, item, params):
        return hf_run(self.ctx, item, params, assistant=self.assistant, **self.extra)


@register
class HFPromptLookup(Method):
    name = "hf-prompt-lookup"

    def run(self, item, params):
        return hf_run(
            self.ctx,
            item,
            params,
            prompt_lookup_num_tokens=self.ctx.prompt_lookup_tokens,
            max_matching_ngram_size=self.ctx.max_matching_ngram,
        )


# ---- Triton server ---------------------------------------------------------------------------
def _predicted_at(perf: dict) -> list[float] | None:
    """The confidence head's summed predictions from a response's perf_metrics (the server reports their
    per-step mean, predicted_per_position; None without a head)."""
    per, steps = perf.get("predicted_per_position"), sum(perf.get("accept_hist") or [])
    return [p * steps for p in per] if per and steps else None


@register
class DFlashTriton(Method):
    """Ours through Triton: the streaming front door (`dflash_bls`), TTFT as the client sees it.
    Uses --triton-url if given, else starts a server on loopback ports for the bench's models."""

    name = "dflash-triton"

    def prepare(self):
        try:
            # deferred: optional dependency (the `serve` extra)
            import tritonclient.grpc  # noqa: F401

        except ImportError as e:
            raise MethodUnavailable(f"serving not available ({e}); pip install 'dflash-trt[serve]'") from None
        self.server = None
        url = self.ctx.triton_url
        if not url:
            try:
                self.server = self.ctx.start_server()
            except (DFlashError, ImportError, OSError) as e:
                raise MethodUnavailable(f"cannot start tritonserver: {e}") from None
            url = self.server.grpc_url
        self.url = url
        self.client = DFlashClient(url)
        if not self.client.is_ready():
            self.close()
            raise MethodUnavailable(f"Triton server at {url} is not ready (model dflash_unary)")

    def request_kwargs(self, params: SamplingParams) -> dict:
        # the server stops on the model's EOS only; our stop ids (e.g. <|endoftext|> next to <|im_end|>) go
        # as stop words, which its tokenizer maps back to the special tokens
        tok = self.ctx.tokenizer
        words = [w for w in tok.convert_ids_to_tokens(list(params.stop_token_ids)) if w and w in tok.all_special_tokens]
        kw = dict(
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            apply_chat_template=self.ctx.chat,
            return_perf_metrics=True,
            stop_words=words or None,
        )
        if params.seed is not None and not params.greedy:
            kw["seed"] = params.seed
        return kw

    def run(self, item, params):
        t0, first, parts, last = time.perf_counter(), None, [], {}
        for chunk in self.client.stream(item.text, params.max_new_tokens, **self.request_kwargs(params)):
            if first is None and chunk["text"]:
                first = time.perf_counter()
            parts.append(chunk["text"])
            last = chunk
        wall = time.perf_counter() - t0
        perf = last.get("perf_metrics") or {}
        return Run(
            None,
            int(last.get("num_output_tokens") or 0),
            (first or time.perf_counter()) - t0,
            wall,
            list(perf.get("accept_hist") or []),
            float(perf.get("draft_time") or 0.0),
            float(perf.get("verify_time") or 0.0),
            text="".join(parts),
            drafts_verified=last.get("total_draft_tokens"),
            predicted_at=_predicted_at(perf),
            sources=perf.get("sources"),
        )

    def close(self):
        if getattr(self, "client", None) is not None:
            self.client.close()
            self.client = None
        if getattr(self, "server", None) is not None:
            self.server.__exit__(None, None, None)
            self.server = None
