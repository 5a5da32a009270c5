"""`BuildConfig`: what `dflash-trt build` builds, from one YAML file plus CLI overrides.

Boundary: the schema and its validation only (no model files are read here; `stages.check`
verifies that target and drafter fit together). Every field is also a `dflash-trt build --field`
option; its help text is the `# comment` on the field's line (config.field_help), so the YAML
schema, `--help` and the code document a field in one place. Validation errors are one line that
names the field and the fix (ConfigError, exit code 2 in the CLI).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path

from dflash_trt.config import load_yaml_dataclass
from dflash_trt.decoding.draft_length import check_cutoff, length_source
from dflash_trt.decoding.options import DEFAULT_PROPOSER
from dflash_trt.decoding.proposers import CHOICES
from dflash_trt.deploy.quantize import check_kv_cache, check_quant_target
from dflash_trt.errors import ConfigError

BACKENDS = ("torch", "trtllm-pytorch")
# TensorRT-LLM's TensorRT engine backend (trtllm-build, TensorRT-LLM <= 1.2) was removed upstream in
# July 2026; a build.yaml written for it gets this one line instead of "unknown backend"
REMOVED_BACKENDS = {
    "tensorrt-llm": (
        "backend=tensorrt-llm: TensorRT-LLM no longer builds TensorRT engines (its engine backend was removed "
        "in July 2026); use backend: trtllm-pytorch (TensorRT-LLM >= 1.3 PyTorch backend, served by Triton's "
        "llmapi model), or backend: torch"
    )
}
QUANTS = ("bf16", "fp8", "nvfp4")
KV_CACHES = ("bf16", "fp8")
SMS = ("sm_90", "sm_100", "sm_120")
DTYPES = ("auto", "bfloat16", "float16", "float32")
EMITS = ("vllm", "sglang")
ATTENTION_BACKENDS = ("auto", "trtllm", "flashinfer", "vanilla")


@dataclass
class BuildConfig:
    """One build: a target + drafter pair -> engines + a Triton model repository."""

    target: str = None  # target model: a registry name (`dflash-trt models list`) or a Hugging Face folder
    drafter: str = None  # DFlash drafter folder (z-lab layout: config.json + model.safetensors)
    tokenizer: str | None = None  # tokenizer folder (default: the target folder)
    backend: str = "torch"  # torch (dflash-trt engine in Triton) | trtllm-pytorch (TensorRT-LLM >= 1.3)
    target_quant: str = "bf16"  # target weights: bf16 | fp8 | nvfp4 (Model Optimizer HF layout)
    drafter_quant: str = "bf16"  # drafter weights: bf16 | fp8 | nvfp4
    kv_cache: str = "bf16"  # KV cache precision: bf16 | fp8
    sm: str = "sm_90"  # GPU generation targeted: sm_90 (Hopper) | sm_100 | sm_120 (Blackwell)
    tp_size: int = 1  # tensor-parallel ranks (trtllm-pytorch, vllm / sglang commands; torch runs one rank)
    pp_size: int = 1  # pipeline-parallel ranks (trtllm-pytorch, vllm / sglang commands)
    ep_size: int = 1  # expert-parallel ranks of a MoE target (trtllm-pytorch, vllm / sglang); 1 = off
    cuda_graph_batch_sizes: list[int] = field(
        default_factory=list
    )  # batch sizes captured as CUDA graphs by TensorRT-LLM / vLLM / SGLang (empty = the engine's default)
    attention_backend: str = "auto"  # trtllm-pytorch attn_backend: auto (TRTLLM) | trtllm | flashinfer | vanilla
    dtype: str = "auto"  # compute dtype: auto (fp32 CPU, bf16 GPU; TRT-LLM: the model's) | bfloat16 | float16 | float32
    max_batch: int = 16  # most concurrent sequences per engine step
    max_seq_len: int = 2048  # most tokens per sequence (prompt + output)
    triton_max_batch_size: int = 64  # Triton max_batch_size of the model entry points
    instance_count: int = 2  # Triton instances of the unary text model
    chat: bool = (
        True  # served prompts go through the tokenizer's chat template (when it has one); requests can override
    )
    decoupled: bool = True  # streaming engine + dflash_bls; false: unary engine + ensemble (HTTP /infer)
    cpu_threads: int = 0  # torch intra-op threads of the served engine process (0 = torch's default)
    draft_cutoff: float = (
        0.0  # verify only the drafts the drafter is this sure of (0 = all; a CPU host gains from ~0.3)
    )
    draft_length: str = "block"  # what draft_cutoff gates: block (drafter probabilities) | confidence (DSpark head)
    proposer: str = DEFAULT_PROPOSER  # where the served drafts come from: decoding/options.py EngineOptions.proposer
    max_queue: int = 256  # served requests waiting for a free batch row; the next ones get "overloaded, retry later"
    calib_prompts: int = 16  # calibration prompts for activation scales (fp8 / nvfp4)
    calib_seq_len: int = 512  # tokens per calibration prompt (longer ones are cut; at most max_seq_len)
    awq: bool = False  # target_quant nvfp4: Model Optimizer's AWQ-lite (NVFP4_AWQ_LITE_CFG) instead of max calibration
    calib_source: str = "stdlib"  # calibration prompts: stdlib | FILE.txt | FILE.jsonl
    eval_prompts: int = 8  # held-out prompts for the quantized-vs-bf16 report (0 disables)
    eval_source: str = "builtin"  # held-out prompts: builtin | humaneval | writingbench | FILE
    eval_max_new_tokens: int = 64  # greedy tokens generated per eval prompt
    emit: list[str] = field(default_factory=list)  # also write serving commands for: vllm, sglang (comma-separated)

    def __post_init__(self):
        self._check_types()
        if str(self.backend).strip().lower() in REMOVED_BACKENDS:
            raise ConfigError(REMOVED_BACKENDS[str(self.backend).strip().lower()])
        self._one_of("backend", BACKENDS)
        self._one_of("target_quant", QUANTS)
        self._one_of("drafter_quant", QUANTS)
        self._one_of("kv_cache", KV_CACHES)
        self._one_of("sm", SMS)
        self._one_of("dtype", DTYPES)
        self._one_of("attention_backend", ATTENTION_BACKENDS)
        for name in (
            "tp_size",
            "pp_size",
            "ep_size",
            "max_batch",
            "triton_max_batch_size",
            "instance_count",
            "eval_max_new_tokens",
            "max_queue",
            "calib_seq_len",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 1")
        for name in ("cpu_threads", "eval_prompts", "calib_prompts"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 0")
        length_source(self.draft_length, check_cutoff(self.draft_cutoff))
        self._one_of("proposer", CHOICES)  # the engine's values (decoding/engine.py); check fits them to the drafter
        if self.max_seq_len < 2:
            raise ConfigError(f"max_seq_len={self.max_seq_len}: must be >= 2 (a prompt token plus one output)")
        if self.quantized and self.calib_prompts < 1:
            raise ConfigError(
                "calib_prompts=0: fp8 / nvfp4 need calibration prompts for their activation "
                "scales; set calib_prompts >= 1 (e.g. 16)"
            )
        if self.awq and self.target_quant != "nvfp4":
            raise ConfigError(
                f"awq=true with target_quant={self.target_quant}: Model Optimizer's AWQ is for nvfp4 here; "
                f"set target_quant: nvfp4 or awq: false"
            )
        if self.eval_source == self.calib_source:
            raise ConfigError(
                f"eval_source={self.eval_source}: must differ from calib_source (held-out prompts "
                f"measure the quantized models; calibration prompts would flatter them)"
            )
        emit = self.emit.split(",") if isinstance(self.emit, str) else list(self.emit or [])
        self.emit = [e.strip().lower() for e in emit if str(e).strip()]
        bad = [e for e in self.emit if e not in EMITS]
        if bad:
            raise ConfigError(f"emit={bad[0]}: unknown; use any of {', '.join(EMITS)} (a list, or comma-separated)")
        self._check_graph_sizes()
        self._check_gpu_generation()

    # ---- helpers --------------------------------------------------------------------------
    @property
    def quantized(self) -> bool:
        return self.target_quant != "bf16" or self.drafter_quant != "bf16"

    @property
    def kv_quant(self) -> str | None:
        """The KV cache's quantised format (None: bf16, not quantised), as the quantize functions take it."""
        return None if self.kv_cache == "bf16" else self.kv_cache

    def quant_of(self, which: str) -> str:
        """'target' | 'drafter' -> its weight format."""
        return self.target_quant if which == "target" else self.drafter_quant

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def _one_of(self, name: str, allowed: tuple[str, ...]) -> None:
        v = getattr(self, name)
        if isinstance(v, str):
            v = v.strip().lower()
            setattr(self, name, v)
        if v not in allowed:
            raise ConfigError(f"{name}={v!r}: unknown; use one of {', '.join(allowed)}")

    def _check_types(self) -> None:
        """YAML and CLI values arrive untyped: check each against the field's annotation (ints may
        come as '8'; bools as true/false), so a wrong type is one line naming the field."""
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            v, (base, optional) = getattr(self, f.name), _split_optional(hints[f.name])
            if v is None:
                if not optional:
                    raise ConfigError(
                        f"{f.name}: required; set it in the YAML file or pass --{f.name.replace('_', '-')}"
                    )
                continue
            coerce = _list_value if typing.get_origin(base) is list else _COERCE.get(base)
            if coerce is not None:
                setattr(self, f.name, coerce(f.name, v))

    def _check_graph_sizes(self) -> None:
        raw = self.cuda_graph_batch_sizes
        items = raw.split(",") if isinstance(raw, str) else list(raw or [])
        sizes = []
        for v in (str(x).strip() for x in items):
            if not v:
                continue
            if not v.isdigit() or int(v) < 1:
                raise ConfigError(f"cuda_graph_batch_sizes={raw!r}: {v!r} is not a batch size >= 1 (e.g. 1,2,4,8)")
            sizes.append(int(v))
        if sizes and max(sizes) > self.max_batch:
            raise ConfigError(
                f"cuda_graph_batch_sizes={sizes}: {max(sizes)} is above max_batch={self.max_batch}; "
                f"drop it or raise max_batch"
            )
        self.cuda_graph_batch_sizes = sorted(set(sizes))

    def _check_gpu_generation(self) -> None:
        """NVFP4 tensor cores exist on Blackwell only: refuse nvfp4 for sm_90 (quantize.check_quant_target
        decides; its message is re-worded to this config's field names). An fp8 KV cache needs a
        quantised target to carry its calibrated scales (quantize.check_kv_cache)."""
        check_kv_cache(self.target_quant, self.kv_quant)
        for name in ("target_quant", "drafter_quant"):
            try:
                check_quant_target(getattr(self, name), self.sm, self.kv_quant)
            except ConfigError as e:
                msg = str(e).replace("quantization.weights", name).replace("gpu_arch", "sm")
                raise ConfigError(msg.replace(": use fp8", f": use {name}: fp8, or sm: sm_100 / sm_120")) from None


# ---- untyped YAML / CLI values -> a field's type (BuildConfig._check_types) ----------------------
def _split_optional(t) -> tuple[object, bool]:
    """(the type inside `X | None`, whether None is allowed)."""
    optional = type(None) in typing.get_args(t)
    return (next((a for a in typing.get_args(t) if a is not type(None)), t) if optional else t), optional


def _bool_value(name: str, v):
    if isinstance(v, str) and v.lower() in ("true", "false", "yes", "no", "1", "0"):
        v = v.lower() in ("true", "yes", "1")
    if not isinstance(v, bool):
        raise ConfigError(f"{name}={v!r}: must be true or false")
    return v


def _int_value(name: str, v):
    if isinstance(v, bool) or not isinstance(v, (int, str)):
        raise ConfigError(f"{name}={v!r}: must be an integer")
    try:
        return int(v)
    except ValueError:
        raise ConfigError(f"{name}={v!r}: must be an integer") from None


def _str_value(name: str, v):
    if isinstance(v, Path):
        v = str(v)
    if not isinstance(v, (str, int, float)) or isinstance(v, bool):
        raise ConfigError(f"{name}={v!r}: must be a string")
    return str(v)


def _list_value(name: str, v):
    if not isinstance(v, (list, tuple, str)):
        raise ConfigError(f"{name}={v!r}: must be a list (or a comma-separated string)")
    return v


_COERCE = {bool: _bool_value, int: _int_value, str: _str_value}


def load_build_config(path: str | Path | None, overrides: dict | None = None) -> BuildConfig:
    """BuildConfig from a YAML file plus CLI overrides (None values are ignored); without a file,
    from the overrides alone. Unknown fields are an error naming them and the valid ones."""
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    if path is not None:
        return load_yaml_dataclass(BuildConfig, path, overrides)
    names = {f.name for f in dataclasses.fields(BuildConfig)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ConfigError(f"unknown field(s) {', '.join(unknown)}; valid fields: {', '.join(sorted(names))}")
    for req in ("target", "drafter"):
        if req not in overrides:
            raise ConfigError(f"{req}: required; pass --config build.yaml or --{req} ...")
    return BuildConfig(**overrides)
