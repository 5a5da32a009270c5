"""Configs: sampling parameters and the drafter checkpoint config (z-lab DFlash layout).

Each config is a dataclass validated in __post_init__; errors name the field and the fix.
DrafterConfig reads and writes config.json exactly in the layout of the published z-lab
DFlash checkpoints (architectures ["DFlashDraftModel"] or ["DFlash2DraftModel"], naming the
drafter family in dflash_trt/families; block_size, dflash_config {mask_token_id, target_layer_ids,
the family's own fields}, num_target_layers, Qwen3-style shape fields). Which fields
are read, with which precedence and defaults, and which are refused: drafter_fields.py. Fields
the reference ignores too are kept in `extra` so that a round trip loses nothing.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dflash_trt import drafter_fields, families
from dflash_trt.drafter_fields import ARCHITECTURE, FULL, LAYER_TYPES, SLIDING
from dflash_trt.errors import CheckpointError, ConfigError
from dflash_trt.families.capabilities import caps_of, check_draft_vocab


@dataclass
class SamplingParams:
    """How tokens are chosen. temperature below GREEDY_TEMPERATURE (0 included) means greedy (and
    exact output equality): dividing logits by a tinier temperature overflows to inf/NaN, and
    sampling at such a temperature is numerically the argmax anyway (vLLM's _SAMPLING_EPS).

    Logit controls (vLLM's definitions, which TensorRT-LLM's penalty kernels match), applied to the
    target's logits before temperature / top-k / top-p, in this order (decoding/penalties.py):
      bad_words_ids       a word's last token gets -inf where the context ends with the word's other
                          tokens (a one-token word is always banned)
      min_tokens          the stop tokens (stop_token_ids, and EOS unless ignore_eos) get -inf while
                          fewer than min_tokens tokens have been generated
      repetition_penalty  tokens of the prompt or the output: logit / r if logit > 0, else logit * r
      frequency_penalty   logit -= f * (times the token occurs in the output)
      presence_penalty    logit -= p * (1 if the token occurs in the output)
    Speculative decoding stays lossless: verification applies them at every block position with the
    context up to that position (decoding/penalties.py), the drafter's proposals are not penalised."""

    GREEDY_TEMPERATURE = 1e-5  # class constant, not a field: temperature < this decodes greedily

    temperature: float = 0.0  # < GREEDY_TEMPERATURE = greedy; above = lossless rejection sampling
    top_k: int = 0  # keep the k most likely tokens (0 = off)
    top_p: float = 1.0  # nucleus mass in (0, 1] (1 = off)
    max_new_tokens: int = 128  # generated tokens per prompt, stop tokens included
    stop_token_ids: tuple[int, ...] = ()  # generation ends after any of these (EOS is added by the loop)
    seed: int | None = None  # seeds the sampler; same seed, same output
    ignore_eos: bool = False  # keep generating past EOS (benchmarks)
    repetition_penalty: float = 1.0  # > 0; prompt + output tokens: logit / r if > 0 else logit * r (1 = off)
    presence_penalty: float = 0.0  # logit -= p for tokens already in the output (0 = off)
    frequency_penalty: float = 0.0  # logit -= f * the token's count in the output (0 = off)
    min_tokens: int = 0  # stop tokens / EOS cannot be generated before this many output tokens (0 = off)
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # token-id words never generated (last token banned)

    def __post_init__(self):
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ConfigError(
                f"temperature={self.temperature}: must be a finite number >= 0 "
                f"(below {self.GREEDY_TEMPERATURE:g} is greedy)"
            )
        if self.top_k < 0:
            raise ConfigError(f"top_k={self.top_k}: must be >= 0 (0 disables top-k)")
        if not (0.0 < self.top_p <= 1.0):
            raise ConfigError(f"top_p={self.top_p}: must be in (0, 1] (1 disables top-p)")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={self.max_new_tokens}: must be >= 1")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        self._check_logit_controls()

    def _check_logit_controls(self) -> None:
        from numbers import Integral, Real  # numpy scalars (Triton inputs) are registered as these

        r = self.repetition_penalty
        if isinstance(r, bool) or not isinstance(r, Real) or not math.isfinite(r) or r <= 0:
            raise ConfigError(f"repetition_penalty={r!r}: must be a finite number > 0 (1 disables it)")
        self.repetition_penalty = float(r)
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, Real) or not math.isfinite(v):
                raise ConfigError(f"{name}={v!r}: must be a finite number (0 disables it)")
            setattr(self, name, float(v))
        m = self.min_tokens
        if isinstance(m, bool) or not isinstance(m, Integral) or not 0 <= m <= self.max_new_tokens:
            raise ConfigError(
                f"min_tokens={m!r}: must be an integer in 0..max_new_tokens={self.max_new_tokens} (0 disables it)"
            )
        self.min_tokens = int(m)
        try:
            words = tuple(tuple(int(t) for t in w) for w in self.bad_words_ids)
        except (TypeError, ValueError):
            words = ((),)  # not a list of lists of ints: refused below
        if any(not w or min(w) < 0 for w in words):
            raise ConfigError(
                f"bad_words_ids={self.bad_words_ids!r}: every word must be a non-empty list of token ids >= 0"
            )
        self.bad_words_ids = words

    @property
    def has_logit_controls(self) -> bool:
        """Any of the penalties / min_tokens / bad_words set (else the logits are used as they are)."""
        return bool(
            self.repetition_penalty != 1.0
            or self.presence_penalty
            or self.frequency_penalty
            or self.min_tokens
            or self.bad_words_ids
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < self.GREEDY_TEMPERATURE


def check_block_size(value: int, name: str = "block_size") -> int:
    """The one block-size rule, >= 2: the last verified token plus at least one draft (ConfigError naming `name`)."""
    if int(value) < 2:
        raise ConfigError(f"{name}{' ' if name.startswith('--') else '='}{value}: must be >= 2 (last token + a draft)")
    return int(value)


def default_target_layer_ids(num_target_layers: int, num_taps: int = 5) -> list[int]:
    """Tap layers spread evenly: round(1 + i*(L-4)/(n-1)) as in the DFlash paper, clamped for tiny L."""
    L = num_target_layers
    if num_taps < 1:
        raise ConfigError(f"num_taps={num_taps}: must be >= 1")
    if num_taps == 1:  # the reference, SpecForge and SGLang tap the middle layer
        return [L // 2]
    if L < 4:
        return sorted({min(L - 1, i * (L - 1) // (num_taps - 1)) for i in range(num_taps)})
    return [int(round(1 + i * (L - 4) / (num_taps - 1))) for i in range(num_taps)]


@dataclass
class DrafterConfig:
    """Shape and DFlash settings of a drafter checkpoint."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int  # drafter layers (1-8, typically 5)
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int  # decoder layers of the target this drafter was made for
    target_layer_ids: list[int]  # target layers whose outputs are fused into the context feature
    mask_token_id: int  # token that fills the B-1 not-yet-drafted block slots
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 32768
    hidden_act: str = "silu"
    attention_bias: bool = False
    dtype: str = "bfloat16"
    # Draft vocabulary (dflash_config.draft_vocab_size): the drafter's LM head covers only these
    # token ids (tensor `draft_vocab` in model.safetensors), as EAGLE-3's reduced draft vocab does.
    # None = the target's full vocabulary. Cuts the head's cost (most of a small drafter's FLOPs).
    draft_vocab_size: int | None = None
    # z-lab fields the reference honours (drafter_fields.py reads them with its precedence):
    input_embedding_scale: float = 1.0  # block input embeddings are multiplied by this
    output_multiplier: float = 1.0  # draft logits are multiplied by this
    final_logit_softcapping: float | None = None  # draft logits -> c * tanh(logits / c); None or 0 = off
    is_causal: bool | None = None  # every layer causal (True) or not (False); None: sliding layers only
    layer_types: list[str] | None = None  # per layer "full_attention" | "sliding_attention"; None = all full
    sliding_window: int | None = None  # window of sliding layers (None: no window, a sliding layer is causal)
    architectures: list[str] | None = field(default_factory=lambda: [ARCHITECTURE])  # kept as read; names the family
    family_fields: dict[str, Any] = field(default_factory=dict)  # the family's own dflash_config fields
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        for name in drafter_fields.SIZES:
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 1")
        check_block_size(self.block_size)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        if not self.target_layer_ids:
            raise ConfigError("dflash_config.target_layer_ids is empty: list the target layers to tap")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise ConfigError(
                f"dflash_config.target_layer_ids {bad} outside 0..{self.num_target_layers - 1} "
                f"(num_target_layers={self.num_target_layers})"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(
                f"dflash_config.mask_token_id={self.mask_token_id}: must be a token id " f"in 0..{self.vocab_size - 1}"
            )
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ConfigError(
                f"dflash_config.draft_vocab_size={self.draft_vocab_size}: must be in 1..{self.vocab_size} "
                f"(or absent for the full vocabulary)"
            )
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act={self.hidden_act!r}: only 'silu' drafters are supported")
        self._check_dflash_math()

    def _check_dflash_math(self) -> None:
        for name in ("input_embedding_scale", "output_multiplier"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ConfigError(f"dflash_config.{name}={v!r}: must be a finite number (1.0 = off)")
            setattr(self, name, float(v))
        cap = self.final_logit_softcapping
        if cap is not None:
            if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap) or cap < 0:
                raise ConfigError(f"dflash_config.final_logit_softcapping={cap!r}: must be > 0, or 0 / null for off")
            self.final_logit_softcapping = float(cap) if cap > 0 else None  # 0 is off, as in the reference
        if self.is_causal is not None and not isinstance(self.is_causal, bool):
            raise ConfigError(f"is_causal={self.is_causal!r}: must be true, false or absent")
        if self.layer_types is not None:
            self.layer_types = list(self.layer_types)
            if len(self.layer_types) != self.num_hidden_layers:
                raise ConfigError(
                    f"layer_types has {len(self.layer_types)} entries: need one per drafter layer "
                    f"(num_hidden_layers={self.num_hidden_layers})"
                )
            bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if bad:
                raise ConfigError(f"layer_types {bad}: not supported (supported: {', '.join(LAYER_TYPES)})")
        w = self.sliding_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ConfigError(
                f"sliding_window={w!r}: must be a positive number of tokens " f"(or use_sliding_window=false for none)"
            )
        if self.architectures is not None:
            self.architectures = list(self.architectures)
            if len(self.architectures) != 1 or self.architectures[0] not in families.FAMILIES:
                raise ConfigError(
                    f"architectures={self.architectures}: expected one of "
                    f"{', '.join(repr([a]) for a in families.FAMILIES)}"
                )
        self.family_fields = {**self.family.DEFAULTS, **self.family_fields}  # optional fields left out
        unknown = sorted(set(self.family_fields) - set(self.family.CONFIG_KEYS))
        if unknown:
            raise ConfigError(f"family_fields {unknown}: not fields of a {self.family.LABEL} drafter")
        check_draft_vocab(self.family, self.draft_vocab_size)
        self.family.check_fields(self.family_fields, self)

    @property
    def family(self):
        """The drafter family module (dflash_trt/families) that `architectures` names."""
        return families.for_architectures(self.architectures)

    def layer_attention(self, i: int) -> tuple[bool, int | None]:
        """(causal, window) of drafter layer i, as the reference resolves them: a sliding layer is
        causal unless is_causal says otherwise and has the window; a full layer has none."""
        kind = self.layer_types[i] if self.layer_types else FULL
        causal = kind == SLIDING if self.is_causal is None else self.is_causal
        return causal, (self.sliding_window if kind == SLIDING else None)

    @property
    def plain_attention(self) -> bool:
        """Every layer attends to the whole context and block (the DFlash paper's layout)."""
        return all(self.layer_attention(i) == (False, None) for i in range(self.num_hidden_layers))

    def beyond_paper(self) -> list[str]:
        """The z-lab fields set here that the DFlash paper's drafter lacks (for backends that
        implement only that drafter: they refuse the checkpoint naming these)."""
        out = [
            f"dflash_config.{name}"
            for name, plain in (
                ("input_embedding_scale", 1.0),
                ("output_multiplier", 1.0),
                ("final_logit_softcapping", None),
            )
            if getattr(self, name) != plain
        ]
        if not caps_of(self.family).kernels:
            out.append(f"architectures {self.architectures} ({self.family.LABEL})")
        return out + ([] if self.plain_attention else ["is_causal / layer_types / sliding_window"])

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def for_target(
        cls,
        target_config,
        num_layers: int = 5,
        block_size: int = 16,
        target_layer_ids: list[int] | None = None,
        num_taps: int = 5,
        mask_token_id: int | None = None,
    ) -> DrafterConfig:
        """Config of a new drafter for a Hugging Face target config (Qwen2/Qwen3/Llama)."""
        tc = target_config
        L = tc.num_hidden_layers
        head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
        if mask_token_id is None:
            mask_token_id = pick_mask_token_id(tc)
        rope_theta, rope_scaling = _rope_of(tc)
        return cls(
            hidden_size=tc.hidden_size,
            intermediate_size=tc.intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=tc.num_attention_heads,
            num_key_value_heads=tc.num_key_value_heads,
            head_dim=head_dim,
            vocab_size=tc.vocab_size,
            num_target_layers=L,
            target_layer_ids=(
                target_layer_ids if target_layer_ids is not None else default_target_layer_ids(L, min(num_taps, L))
            ),
            mask_token_id=mask_token_id,
            block_size=block_size,
            rms_norm_eps=tc.rms_norm_eps,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=tc.max_position_embeddings,
        )

    # ---- z-lab config.json (fields, precedence and refusals: drafter_fields.py) ------------
    def to_json_dict(self, portable: bool = False) -> dict:
        """config.json content. portable=True: without dflash-trt's draft-vocabulary extension."""
        return drafter_fields.write(self, portable)

    @classmethod
    def from_json_dict(cls, d: dict) -> DrafterConfig:
        return cls(**drafter_fields.read(d))

    def save(self, folder: str | Path, portable: bool = False) -> None:
        Path(folder, "config.json").write_text(json.dumps(self.to_json_dict(portable), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, folder: str | Path) -> DrafterConfig:
        path = Path(folder, "config.json")
        if not path.is_file():
            raise CheckpointError(
                f"{path}: not found; a drafter checkpoint is a folder with config.json and model.safetensors"
            )
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path}: not valid JSON ({e})") from None
        return cls.from_json_dict(d)


def _rope_of(tc) -> tuple[float, dict | None]:
    """rope_theta and non-default scaling of a transformers config (v4 or v5 style)."""
    rp = getattr(tc, "rope_parameters", None) or {}
    theta = rp.get("rope_theta", getattr(tc, "rope_theta", 10000.0))
    scaling = getattr(tc, "rope_scaling", None)
    if rp.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
    if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(theta), scaling


def pick_mask_token_id(target_config) -> int:
    """The last row of the target's embedding table. In the Qwen families that row lies past the
    tokenizer's vocabulary (never produced by the target); elsewhere it is a rare token. Either
    way only the drafter ever sees it, as a constant "not yet drafted" input."""
    return int(target_config.vocab_size - 1)


def load_yaml_dataclass(cls, path: str | Path, overrides: dict | None = None):
    """Build dataclass `cls` from a YAML file plus CLI overrides; unknown fields are an error."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} not found")
    data = yaml.safe_load(p.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: top level must be a mapping of field: value")
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{p}: unknown field(s) {', '.join(unknown)}; valid fields: {', '.join(sorted(names))}")
    return cls(**data)


def field_help(cls) -> dict[str, str]:
    """Help text of each dataclass field: the `# comment` on its line in the class body, so that the
    YAML schema, the CLI --help and the code document a field in one place."""
    out: dict[str, str] = {}
    try:
        src = inspect.getsource(cls)
    except (OSError, TypeError):
        return out
    # black wraps a long `name: T = default  # help` as `name: T = (\n    default  # help\n)`
    for m in re.finditer(r"^\s+(\w+)\s*:[^#\n]*(?:\(\n[^#\n]*)?#\s*(.+)$", src, re.M):
        out.setdefault(m.group(1), m.group(2).strip())
    return out
