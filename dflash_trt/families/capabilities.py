"""What each drafter family can run on: the deploy-side declaration every family module carries as `CAPS`.

Boundary: the declaration's shape and the lookups on it (`caps_of`, `engine_of`, `refusal`). The facts
(which engine runs which family, under which method name, what stays unquantized) live in each family
module next to its weights; deploy/ (emit, emit_layout, trtllm, check, quantize) and the decoding-side
switches read them here instead of comparing family names. A family module without `CAPS` is refused
by every engine (one line naming the family), so a new family is never written out as plain DFlash.

Engines (ENGINES): `vllm` (0.33, --speculative-config method), `sglang` (0.5.23,
--speculative-algorithm), `trtllm-pytorch` (TensorRT-LLM >= 1.3, speculative_config decoding_type)
and `torch` (dflash-trt's own engine, which runs every declared family).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from dflash_trt.errors import ConfigError

ENGINES = ("vllm", "sglang", "trtllm-pytorch", "torch")
LABELS = {"vllm": "vLLM 0.33", "sglang": "SGLang 0.5.23", "trtllm-pytorch": "TensorRT-LLM", "torch": "dflash-trt"}


@dataclass(frozen=True)
class EngineSupport:
    """How one engine runs a family.

    layout: the engine's own name for it (vLLM method, SGLang algorithm, TensorRT-LLM decoding_type);
    architecture: the `architectures` entry of the serving copy's config.json (None: the family's own);
    quantized_drafter: the engine's loader reads a Model Optimizer FP8 / NVFP4 drafter of this family
      correctly (False: the build gives it the bf16 copy and says so);
    draft_vocab: the engine drafts over a draft vocabulary (False: a drafter's draft vocabulary is dropped
      there and it drafts over the target's whole LM head; the build says so);
    top_level_only: family fields this engine must find at the top level of config.json and NOT inside
      dflash_config (an engine whose parent class refuses them there);
    source: where the claims come from (file:line in the engine's package), for the reader."""

    layout: str
    architecture: str | None = None
    quantized_drafter: bool = False
    draft_vocab: bool = False
    top_level_only: tuple[str, ...] = ()
    source: str = ""


@dataclass(frozen=True)
class Capabilities:
    """A family's deploy-side declaration (`CAPS` in its module).

    engines: engine name -> EngineSupport; refused: engine name -> why it cannot (one line, with the fix);
    quant_exclude: module-name patterns (fnmatch, modelopt's exclude_modules style) that are never
      quantized in a drafter of this family (heads, GRU, selector, embeddings); they are listed in the
      checkpoint's exclude_modules so an engine's loader keeps them in bf16;
    kernels / cuda_graph: the Triton kernels / the CUDA-graph replay implement this family;
    draft_vocab: a draft vocabulary (draft_vocab_size) is defined for it; draft_cutoff: propose gives a
      per-draft probability (--draft-cutoff, hybrid's copy-vs-draft choice); hybrid: the hybrid proposer
      can run it;
    top_level: family config fields vLLM / SGLang read at the top level of config.json;
    field_refusal(engine, fields, drafter_quant) -> why this drafter's own field values cannot run there
      (None: they can);
    drafts(dc) -> draft tokens per step in the serving engines (vLLM, SGLang, TensorRT-LLM)."""

    engines: Mapping[str, EngineSupport]
    refused: Mapping[str, str] = field(default_factory=dict)
    quant_exclude: tuple[str, ...] = ()
    kernels: bool = False
    cuda_graph: bool = False
    draft_vocab: bool = False
    draft_cutoff: bool = True
    hybrid: bool = True
    top_level: tuple[str, ...] = ()
    field_refusal: Callable[[str, dict, str], str | None] | None = None
    drafts: Callable[[object], int] = lambda dc: dc.block_size - 1  # the block is anchor + B-1 masks

    def __post_init__(self):
        bad = sorted((set(self.engines) | set(self.refused)) - set(ENGINES))
        if bad:
            raise ValueError(f"capabilities name unknown engines {bad}; engines are {', '.join(ENGINES)}")
        both = sorted(set(self.engines) & set(self.refused))
        if both:
            raise ValueError(f"capabilities both support and refuse {both}")


# the module-name patterns never quantized in any drafter: embeddings and the (shared) LM head
ALWAYS_EXCLUDED = ("lm_head", "*embed_tokens")


def caps_of(family) -> Capabilities:
    """The family module's CAPS; ConfigError (one line) for a family that declares none."""
    caps = getattr(family, "CAPS", None)
    if not isinstance(caps, Capabilities):
        raise ConfigError(
            f"drafter family {getattr(family, 'LABEL', family)!r} declares no deploy capabilities "
            f"(CAPS in its module, dflash_trt/families/capabilities.py); no engine runs it: add the declaration"
        )
    return caps


def check_draft_vocab(family, draft_vocab_size: int | None) -> None:
    """A draft vocabulary only for a family whose CAPS defines one (ConfigError, one line)."""
    if draft_vocab_size is not None and not caps_of(family).draft_vocab:
        raise ConfigError(
            f"dflash_config.draft_vocab_size: draft vocabularies are not supported for {family.LABEL} drafters; "
            f"drop the field (and the draft_vocab tensor) to draft over the full vocabulary"
        )


def refusal(family, engine: str, fields: dict, drafter_quant: str = "bf16") -> str | None:
    """Why `engine` cannot run this family's drafter with these fields (None: it can)."""
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r}: one of {', '.join(ENGINES)}")
    try:
        caps = caps_of(family)
    except ConfigError as e:
        return str(e)
    if engine in caps.refused:
        return caps.refused[engine]
    if engine not in caps.engines:
        return f"{engine} has no {family.LABEL} drafter (its capabilities declare none)"
    return caps.field_refusal(engine, fields, drafter_quant) if caps.field_refusal else None


def engine_of(family, engine: str) -> EngineSupport:
    """The EngineSupport of an engine that runs the family (callers refuse the others first)."""
    caps = caps_of(family)
    if engine not in caps.engines:
        raise ConfigError(f"{engine}: no {family.LABEL} drafter ({refusal(family, engine, {}) or 'not declared'})")
    return caps.engines[engine]


def drafter_copy(family, engine: str, drafter_quant: str) -> str:
    """What the engine is given: "quantized" (the Model Optimizer drafter), "bf16" (the bf16 copy of a
    quantized build, since its loader would misread the quantized one) or "bf16-only" (drafter_quant bf16)."""
    quantized = engine_of(family, engine).quantized_drafter
    if drafter_quant == "bf16":
        return "bf16-only"
    return "quantized" if quantized else "bf16"
