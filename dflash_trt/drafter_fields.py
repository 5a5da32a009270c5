"""Which fields of a z-lab DFlash drafter config.json dflash-trt reads, with the reference's precedence
and defaults, and which it refuses.

Boundary: config.json dict <-> DrafterConfig keyword arguments (config.py validates the values).
The reference is the authors' `dflash` package (DFlashDraftModel over a transformers Qwen3Config):

  * DFlash fields (block_size, mask_token_id, target_layer_ids, input_embedding_scale,
    output_multiplier, final_logit_softcapping): `dflash_config` wins over the top level, then
    the reference default (block_size 16, scales 1.0, softcap off, taps build_target_layer_ids).
  * Qwen3 shape and attention fields: top level only, Qwen3Config defaults (head_dim 128,
    rope_theta 1e4, sliding_window honoured only with use_sliding_window, layer_types derived
    from max_window_layers when absent, is_causal from the layer type when absent).
  * `architectures` is kept and written back as read; it names the drafter family
    (dflash_trt/families: DFlashDraftModel, DFlash2DraftModel, DSparkDraftModel, DominoDraftModel),
    whose own fields (DFlash 2: conv_* / selector_*; DSpark: markov_* / confidence_*; Domino: emb_dim,
    gru_hidden_dim, ...) are read with the DFlash precedence into DrafterConfig.family_fields. A
    DFlashDraftModel whose dflash_config.projector_type names a family (SGLang writes Domino so)
    is that family, saved under the family's own architecture name (SpecForge's).
  * Unknown `dflash_config` keys are refused: the reference ignores them, but they belong to
    other DFlash variants (SpecForge projector heads, another family) whose math they change. Unknown
    top-level keys are Qwen3/transformers bookkeeping the reference ignores too; they are kept.

Nothing here is silently dropped: a field is implemented, kept for the round trip, or refused
with one line naming it.
"""

from __future__ import annotations

from typing import Any

from dflash_trt import families
from dflash_trt.errors import CheckpointError

ARCHITECTURE = families.DEFAULT.ARCHITECTURE  # a new drafter's, and a config.json's without `architectures`
FULL, SLIDING = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)

# dflash_config keys read here (draft_vocab_size is dflash-trt's own extension, see portable saves)
DFLASH_KEYS = (
    "mask_token_id",
    "target_layer_ids",
    "block_size",
    "input_embedding_scale",
    "output_multiplier",
    "final_logit_softcapping",
    "draft_vocab_size",
)
# dflash_config keys SpecForge writes; harmless at these values (kept), refused at any other
HARMLESS_AT_DEFAULT = {"projector_type": None, "pure_draft_prefix_len": 0, "shift_label": False}

# top-level sizes, each a positive integer (DrafterConfig checks them); read() requires them all
# but the two that have Qwen3Config defaults (_DEFAULTED_SIZES)
SIZES = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "num_target_layers",
)
_DEFAULTED_SIZES = ("num_key_value_heads", "head_dim")

# top-level keys consumed here (everything else is kept in DrafterConfig.extra and written back)
CONSUMED = {
    *SIZES,
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "max_position_embeddings",
    "hidden_act",
    "attention_bias",
    "dflash_config",
    "architectures",
    "model_type",
    "torch_dtype",
    "dtype",
    "tie_word_embeddings",
    "use_sliding_window",
    "sliding_window",
    "max_window_layers",
    "layer_types",
    "is_causal",
    *(k for k in DFLASH_KEYS if k != "draft_vocab_size"),  # dflash-trt's extension: dflash_config only
}


def reference_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference's default taps (no target_layer_ids anywhere): [L // 2] for one layer, else
    round(1 + i*(L-4)/(n-1)). Ids outside the target are refused: they would index the
    embedding output (negative) or nothing at all."""
    L, n = num_target_layers, num_draft_layers
    ids = [L // 2] if n == 1 else [int(round(1 + i * (L - 4) / (n - 1))) for i in range(n)]
    if any(not 0 <= i < L for i in ids):
        raise CheckpointError(
            f"drafter config.json has no target_layer_ids and the reference default for "
            f"{n} drafter layers over {L} target layers is {ids}, outside 0..{L - 1}: "
            f"set dflash_config.target_layer_ids"
        )
    return ids


def _check_architectures(archs) -> list[str] | None:
    if archs is None:
        return None
    if not isinstance(archs, list) or not archs:
        raise CheckpointError(f'drafter config.json architectures={archs!r}: expected ["{ARCHITECTURE}"]')
    families.for_architectures(archs)  # refuses names no family implements
    return list(archs)


def _check_dflash_keys(dc: dict, family) -> dict:
    """The dflash_config keys kept for the round trip; refuses the ones that change the math."""
    kept = {}
    for k, v in dc.items():
        if k in DFLASH_KEYS or k in family.CONFIG_KEYS:
            continue
        owner = families.owner_of(k, v)
        if k in HARMLESS_AT_DEFAULT and v == HARMLESS_AT_DEFAULT[k]:
            kept[k] = v
        elif owner is not None and owner is not family:
            raise CheckpointError(
                f"drafter config.json dflash_config.{k}={v!r}: a {owner.LABEL} field, but architectures names a "
                f'{family.LABEL} drafter ({family.ARCHITECTURE}); use architectures ["{owner.ARCHITECTURE}"] '
                f"or drop the field"
            )
        elif k in HARMLESS_AT_DEFAULT:
            raise CheckpointError(
                f"drafter config.json dflash_config.{k}={v!r}: SpecForge's {k} is not "
                f"implemented (only {HARMLESS_AT_DEFAULT[k]!r}); this drafter would "
                f"draft wrongly, so it is refused"
            )
        else:
            raise CheckpointError(
                f"drafter config.json dflash_config.{k}: unknown to dflash-trt and it may "
                f"change the drafter's math, so the checkpoint is refused (supported keys: "
                f"{', '.join(DFLASH_KEYS)})"
            )
    return kept


def _rope(d: dict) -> tuple[float, dict | None]:
    rp = d.get("rope_parameters") or {}
    theta = d.get("rope_theta")
    if theta is None:
        theta = rp.get("rope_theta", 10000.0)  # Qwen3Config's default, as the reference loads it
    scaling = d.get("rope_scaling")
    if scaling is None and rp.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
    if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(theta), scaling


def _attention_layout(d: dict, n_layers: int) -> tuple[list[str] | None, int | None]:
    """(layer_types or None for all full attention, effective sliding window) as Qwen3Config
    resolves them: the window exists only with use_sliding_window; absent layer_types make
    layers >= max_window_layers sliding when there is a window."""
    window = d.get("sliding_window", 4096) if d.get("use_sliding_window", False) else None
    types = d.get("layer_types")
    if types is None:
        start = d.get("max_window_layers", 28)
        types = [SLIDING if window is not None and i >= start else FULL for i in range(n_layers)]
        if all(t == FULL for t in types):
            return None, window
    return list(types), window


def read(d: dict) -> dict[str, Any]:
    """config.json dict -> DrafterConfig keyword arguments (CheckpointError on refusal)."""
    archs = _check_architectures(d.get("architectures"))
    family = families.for_architectures(archs)
    dc = d.get("dflash_config") or {}
    if not isinstance(dc, dict):
        raise CheckpointError(f"drafter config.json dflash_config={dc!r}: expected a mapping")
    named = families.owner_of("projector_type", dc.get("projector_type", d.get("projector_type")))
    if family is families.DEFAULT and named is not None:  # SGLang's layout: the projector names the family
        family, archs = named, [named.ARCHITECTURE]
    kept_dc = _check_dflash_keys(dc, family)

    def dflash(name, default=None):  # the reference's precedence: dflash_config, top level, default
        return dc.get(name, d.get(name, default))

    family_fields = {k: dflash(k, family.DEFAULTS.get(k)) for k in family.CONFIG_KEYS}
    absent = [k for k, v in family_fields.items() if v is None and k not in family.DEFAULTS]
    if absent:
        raise CheckpointError(
            f"drafter config.json lacks dflash_config.{', dflash_config.'.join(absent)}, which a "
            f"{family.LABEL} drafter ({family.ARCHITECTURE}) needs"
        )

    missing = [k for k in SIZES if k not in _DEFAULTED_SIZES and d.get(k) is None]
    if dflash("mask_token_id") is None:
        missing.append("dflash_config.mask_token_id")
    if missing:
        raise CheckpointError(f"drafter config.json lacks {', '.join(missing)}: is this a DFlash drafter checkpoint?")
    n_layers = d["num_hidden_layers"]
    ids = dflash("target_layer_ids")
    if ids is None:
        ids = reference_target_layer_ids(d["num_target_layers"], n_layers)
    rope_theta, rope_scaling = _rope(d)
    layer_types, window = _attention_layout(d, n_layers)
    softcap = dflash("final_logit_softcapping")
    extra = {k: v for k, v in d.items() if k not in CONSUMED and k not in family.CONFIG_KEYS}
    if kept_dc:
        extra["dflash_config"] = kept_dc
    return dict(
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_hidden_layers=n_layers,
        num_attention_heads=d["num_attention_heads"],
        num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
        head_dim=d.get("head_dim") or 128,  # Qwen3Config's default, not hidden_size // heads
        vocab_size=d["vocab_size"],
        num_target_layers=d["num_target_layers"],
        target_layer_ids=ids,
        mask_token_id=dflash("mask_token_id"),
        block_size=dflash("block_size", 16),
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=d.get("max_position_embeddings", 32768),
        hidden_act=d.get("hidden_act", "silu"),
        attention_bias=d.get("attention_bias", False),
        dtype=d.get("torch_dtype") or d.get("dtype") or "bfloat16",
        draft_vocab_size=dc.get("draft_vocab_size"),
        input_embedding_scale=dflash("input_embedding_scale", 1.0),
        output_multiplier=dflash("output_multiplier", 1.0),
        final_logit_softcapping=softcap,
        is_causal=d.get("is_causal"),
        layer_types=layer_types,
        sliding_window=window,
        architectures=archs,
        family_fields=family_fields,
        extra=extra,
    )


def write(cfg, portable: bool = False) -> dict:
    """DrafterConfig -> config.json dict in the z-lab layout. portable=True leaves out dflash-trt's
    own extension (draft_vocab_size), so the folder is a plain checkpoint for the reference."""
    d = dict(cfg.extra)
    dc = {
        **d.get("dflash_config", {}),
        "mask_token_id": cfg.mask_token_id,
        "target_layer_ids": list(cfg.target_layer_ids),
        **cfg.family_fields,
    }
    if cfg.draft_vocab_size is not None and not portable:
        dc["draft_vocab_size"] = cfg.draft_vocab_size
    if cfg.input_embedding_scale != 1.0:
        dc["input_embedding_scale"] = cfg.input_embedding_scale
    if cfg.output_multiplier != 1.0:
        dc["output_multiplier"] = cfg.output_multiplier
    if cfg.final_logit_softcapping is not None:
        dc["final_logit_softcapping"] = cfg.final_logit_softcapping
    d.update(
        {
            "model_type": "qwen3",
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_hidden_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim,
            "vocab_size": cfg.vocab_size,
            "rms_norm_eps": cfg.rms_norm_eps,
            "rope_theta": cfg.rope_theta,
            "rope_scaling": cfg.rope_scaling,
            "max_position_embeddings": cfg.max_position_embeddings,
            "hidden_act": cfg.hidden_act,
            "attention_bias": cfg.attention_bias,
            "tie_word_embeddings": False,
            "torch_dtype": cfg.dtype,
            "block_size": cfg.block_size,
            "num_target_layers": cfg.num_target_layers,
            "dflash_config": dc,
        }
    )
    for k in cfg.family.TOP_LEVEL_TOO:
        d[k] = cfg.family_fields[k]
    if cfg.architectures is not None:
        d["architectures"] = list(cfg.architectures)
    if cfg.sliding_window is not None:  # explicit layer types: max_window_layers is not written
        d.update(
            use_sliding_window=True,
            sliding_window=cfg.sliding_window,
            layer_types=list(cfg.layer_types or [FULL] * cfg.num_hidden_layers),
        )
    elif cfg.layer_types is not None:
        d["layer_types"] = list(cfg.layer_types)
    if cfg.is_causal is not None:
        d["is_causal"] = cfg.is_causal
    return d
