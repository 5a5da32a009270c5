"""EngineOptions: how the engine decodes, in one frozen object validated once, documented once.

Boundary: the options every entry point passes to the engine unchanged: the Python API (generate(),
SpecEngine, api.run_generate), the CLI (`generate`, `eval`, `bench`: their flags are generated from these
fields, `cli_flags`), build.yaml (deploy/build_config.py BuildConfig takes the same fields and validates
them here) and the server (serving/engine_factory.py). Per-engine sizes (max_batch, max_seq_len) and
learned state (decoding/session.py) are not options: they belong to the caller.

The default proposer is `dflash` everywhere (the Python API, the CLI, eval, bench, build.yaml, the server),
and `auto` is accepted everywhere. auto (hybrid where the family's CAPS allows it) measured within 3% of the
better of ngram and dflash, and of plain decoding, on every prompt category of two sets, all exact
(docs/performance.md#hybrid-against-its-parts-2026-12-07), but its choices follow this machine's measured
times (verify cost curve, draft time): a seeded sampled request then draws from the same distribution yet
does not repeat token for token from run to run. dflash's choices depend on the text alone, so the default
keeps seeded sampling reproducible (tests/test_penalties.py test_seeded_sampling_with_controls_is_deterministic
fails under auto).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from dflash_trt.decoding.draft_length import DRAFT_LENGTHS, check_cutoff, length_source
from dflash_trt.decoding.proposers import CHOICES
from dflash_trt.errors import ConfigError

KERNELS = ("auto", "triton", "torch")
CUDA_GRAPH = ("auto", "on", "off")
DEFAULT_PROPOSER = "dflash"


def _opt(default, help_text: str, choices=None):
    return field(default=default, metadata={"help": help_text, "choices": choices})


@dataclass(frozen=True)
class EngineOptions:
    proposer: str = _opt(
        DEFAULT_PROPOSER,
        "Where the drafts come from: dflash = the drafter's block; ngram = the continuation copied from the "
        "row's own text (prompt + output; the drafter is not run); hybrid = per row and round the copy or the "
        "drafter's block, or a plain step where neither has been paying; tree = both verified in one target "
        "pass (a tree mask), the branch with more accepted tokens kept; none = plain decoding; auto = hybrid "
        "where the drafter gives per-draft probabilities (DFlash, DSpark, Domino), else dflash. All lossless.",
        CHOICES,
    )
    draft_length: str = _opt(
        "block",
        "How many drafts to verify: block = the whole block, or with --draft-cutoff > 0 the leading drafts the "
        "drafter's own probabilities are sure of; confidence = the drafter's learned confidence head (DSpark "
        "drafters with one), its predicted chance that every kept draft is accepted >= --draft-cutoff (> 0); "
        "cost = the width with the most expected tokens per second under this machine's verify cost, measured "
        "at start-up (no cutoff).",
        DRAFT_LENGTHS,
    )
    draft_cutoff: float = _opt(
        0.0,
        "Verify only the leading drafts whose running product of drafter probabilities is at least this (0: "
        "every draft). Output is unchanged; on a CPU, where verify cost grows with its width, it skips drafts "
        "that would be rejected anyway.",
    )
    kernels: str = _opt(
        "auto",
        "Drafter KV injection / block attention and acceptance: Triton GPU kernels, plain PyTorch, or auto "
        "(Triton on CUDA when installed, else PyTorch).",
        KERNELS,
    )
    cuda_graph: str = _opt(
        "auto",
        "Replay the drafter step from a CUDA graph (needs the Triton kernels on a GPU; auto = when they run).",
        CUDA_GRAPH,
    )

    def __post_init__(self):
        for f in dataclasses.fields(self):
            choices = f.metadata["choices"]
            if choices and getattr(self, f.name) not in choices:
                raise ConfigError(f"{f.name}={getattr(self, f.name)!r}: choose one of {', '.join(choices)}")
        object.__setattr__(self, "draft_cutoff", check_cutoff(self.draft_cutoff))
        length_source(self.draft_length, self.draft_cutoff)  # the length / cutoff pairing, one line

    @classmethod
    def of(cls, options: EngineOptions | None = None, **fields) -> EngineOptions:
        """options (default: the defaults) with the given fields replaced (None: keep); the keyword form
        generate() and SpecEngine accept."""
        unknown = set(fields) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"not EngineOptions fields: {', '.join(sorted(unknown))}")
        return dataclasses.replace(options or cls(), **{k: v for k, v in fields.items() if v is not None})

    @classmethod
    def cli_flags(cls) -> list[tuple[str, object, tuple | None, str]]:
        """(field name, default, choices or None, help) per field: what cli_shared.engine_options turns into
        --flags, so that the commands' flags and their help are these fields'."""
        return [(f.name, f.default, f.metadata["choices"], f.metadata["help"]) for f in dataclasses.fields(cls)]
