"""The `check` build stage: do target, drafter and tokenizer fit together, and what will they cost?

Boundary: reads configs, tokenizer files and safetensors *headers* (never the weights), raises one
line naming the field on the first problem, and returns a summary (parameter counts, weight memory
per precision, KV-cache size for max_batch x max_seq_len) that `print_summary` shows as a table.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from dflash_trt.api import load_tokenizer, resolve_target_dir
from dflash_trt.config import DrafterConfig, check_block_size
from dflash_trt.decoding.proposers import plan
from dflash_trt.deploy.build_config import BuildConfig
from dflash_trt.deploy.emit import check_emit
from dflash_trt.deploy.quantize import quantizable_modules
from dflash_trt.deploy.trtllm import check_expert_parallel, check_trtllm
from dflash_trt.errors import CheckpointError, ConfigError, DFlashError
from dflash_trt.families.capabilities import refusal
from dflash_trt.hub.drafters import bundled_drafters
from dflash_trt.modeling.drafter import check_fit
from dflash_trt.modeling.target import SUPPORTED_MODEL_TYPES

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# bytes per weight of a quantised Linear: fp8 = 1 (+ one fp32 scale per tensor, ignored);
# nvfp4 = 4 bits + one fp8 block scale per 16 values = 0.5 + 1/16
BYTES_PER_WEIGHT = {"bf16": 2.0, "fp8": 1.0, "nvfp4": 0.5 + 1 / 16}
KV_BYTES = {"bf16": 2, "fp8": 1}


def resolve_inputs(cfg: BuildConfig, progress: bool = True) -> dict[str, Path]:
    """Absolute target / drafter / tokenizer folders; errors name the field."""
    try:
        target = resolve_target_dir(cfg.target, progress)
    except ConfigError:
        raise
    except Exception as e:  # unknown registry name, fetch failure, folder without config.json
        msg = str(e)
        raise ConfigError(
            f"target={cfg.target}: {msg[msg.find(':') + 2:] if msg.startswith('--target') else msg}"
        ) from None
    bundled = bundled_drafters()
    drafter = bundled[cfg.drafter].path if cfg.drafter in bundled else Path(cfg.drafter).expanduser()
    if not (drafter / "config.json").is_file():
        raise ConfigError(
            f"drafter={cfg.drafter}: no config.json there; give a DFlash drafter folder "
            f"(z-lab layout, e.g. from `dflash-trt train`)"
        )
    tokenizer = Path(cfg.tokenizer).expanduser() if cfg.tokenizer else target
    return {"target": target.resolve(), "drafter": drafter.resolve(), "tokenizer": tokenizer.resolve()}


def _tensor_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """name -> shape from the safetensors headers of a folder (8-byte length + JSON header)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        shapes.update({k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"})
    if not shapes:
        raise CheckpointError(f"{folder}: no *.safetensors weight files")
    return shapes


def _weights(folder: Path) -> dict:
    """Parameter count split into quantisable Linear weights and the rest (norms, embeddings, head)."""
    shapes = _tensor_shapes(folder)
    numel = {k: math.prod(s) for k, s in shapes.items()}
    quant = sum(numel[m + ".weight"] for m in quantizable_modules(shapes) if m != "lm_head")
    total = sum(v for k, v in numel.items() if k != "draft_vocab")
    return {
        "params": total,
        "quantizable": quant,
        "bytes": {p: int(quant * b + (total - quant) * 2) for p, b in BYTES_PER_WEIGHT.items()},
    }


def _tokenizer_ok(folder: Path) -> None:
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise ConfigError(
            f"tokenizer={folder}: no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}); "
            f"set tokenizer: to the folder that holds them"
        )
    try:
        load_tokenizer(folder)
    except Exception as e:
        raise ConfigError(f"tokenizer={folder}: cannot be loaded ({str(e)[:160]})") from None


def check_tp(name: str, c, tp: int) -> None:
    """tp ranks split attention heads, the MLP and the hidden size evenly; KV heads are split or
    replicated (one of tp and num_key_value_heads divides the other), as TensorRT-LLM, vLLM and
    SGLang require."""
    for field in ("num_attention_heads", "intermediate_size", "hidden_size"):
        n = getattr(c, field)
        if n % tp:
            raise ConfigError(f"tp_size={tp} does not divide the {name}'s {field}={n}; choose a tp_size that does")
    kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    if kv % tp and tp % kv:
        raise ConfigError(f"tp_size={tp} and the {name}'s num_key_value_heads={kv}: one must divide the other")


def check(cfg: BuildConfig, dirs: dict[str, Path]) -> dict:
    """Verify the pair and return the summary dict (raises ConfigError / IncompatibleModelsError)."""
    # deferred: transformers takes ~0.6 s to import, and `dflash-trt --help` imports this module
    from transformers import AutoConfig

    try:
        tc = AutoConfig.from_pretrained(dirs["target"])
    except (OSError, ValueError) as e:
        raise ConfigError(f"target={dirs['target']}: unreadable config.json ({str(e)[:160]})") from None
    if tc.model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"target: model_type={tc.model_type!r} unsupported; use a {', '.join(SUPPORTED_MODEL_TYPES)} model"
        )
    try:
        dc = DrafterConfig.load(dirs["drafter"])
    except (ConfigError, CheckpointError) as e:  # e.g. block_size < 2, mask_token_id outside the vocab
        raise ConfigError(f"drafter {dirs['drafter']}/config.json: {e}") from None
    L = tc.num_hidden_layers
    check_fit(dc, tc.hidden_size, tc.vocab_size, L)  # the one fit rule (modeling/drafter.py)
    check_block_size(dc.block_size, "drafter block_size")
    try:  # the engine's own rules (decoding/proposal.py plan), here before anything is built or served
        plan(cfg.draft_length, cfg.draft_cutoff, cfg.proposer, dc.family, dc.family.lengths(dc))
    except DFlashError as e:
        raise ConfigError(str(e)) from None
    why = refusal(dc.family, "torch", dc.family_fields, cfg.drafter_quant)  # families/*.py CAPS
    if cfg.backend == "torch" and why:  # trtllm-pytorch: check_trtllm reads the same declaration
        raise ConfigError(f"backend=torch: {why}")
    check_emit(
        cfg, dc, tc.model_type
    )  # emit: [vllm, sglang] that cannot serve this drafter is refused before any stage runs
    if cfg.backend == "trtllm-pytorch":  # drafters / layouts TensorRT-LLM cannot run, before any stage runs
        check_trtllm(cfg, tc, dc)
    check_expert_parallel(cfg, tc)
    if cfg.max_seq_len > getattr(tc, "max_position_embeddings", cfg.max_seq_len):
        raise ConfigError(
            f"max_seq_len={cfg.max_seq_len}: above the target's max_position_embeddings="
            f"{tc.max_position_embeddings}; lower it"
        )
    _tokenizer_ok(dirs["tokenizer"])
    if cfg.tp_size > 1:  # the engines that run tp_size > 1 (TensorRT-LLM, vLLM, SGLang) shard heads and MLPs
        for name, c in (("target", tc), ("drafter", dc)):
            check_tp(name, c, cfg.tp_size)
    if "nvfp4" in (cfg.target_quant, cfg.drafter_quant):
        for name, c in (("target", tc), ("drafter", dc)):
            if c.hidden_size % 16 or c.intermediate_size % 16:
                raise ConfigError(
                    f"{name}_quant=nvfp4: hidden_size {c.hidden_size} / intermediate_size "
                    f"{c.intermediate_size} must be multiples of 16 (NVFP4 blocks); use fp8"
                )
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    per_token = {
        "target": 2 * L * tc.num_key_value_heads * head_dim,  # K and V, every layer
        "drafter": 2 * dc.num_hidden_layers * dc.num_key_value_heads * dc.head_dim,
    }
    tokens = cfg.max_batch * cfg.max_seq_len
    return {
        "target": {
            "dir": str(dirs["target"]),
            "model_type": tc.model_type,
            "layers": L,
            "hidden_size": tc.hidden_size,
            "vocab_size": tc.vocab_size,
            "quant": cfg.target_quant,
            **_weights(dirs["target"]),
            "kv_cache_bytes": per_token["target"] * tokens * KV_BYTES[cfg.kv_cache],
        },
        "drafter": {
            "dir": str(dirs["drafter"]),
            "layers": dc.num_hidden_layers,
            "block_size": dc.block_size,
            "target_layer_ids": dc.target_layer_ids,
            "mask_token_id": dc.mask_token_id,
            "quant": cfg.drafter_quant,
            **_weights(dirs["drafter"]),
            "kv_cache_bytes": per_token["drafter"] * tokens * KV_BYTES[cfg.kv_cache],
        },
        "tokenizer": str(dirs["tokenizer"]),
        "backend": cfg.backend,
        "sm": cfg.sm,
        "kv_cache": cfg.kv_cache,
        "max_batch": cfg.max_batch,
        "max_seq_len": cfg.max_seq_len,
    }


def _gib(n: float) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**24 else f"{n / 2**20:.2f} MiB"


def print_summary(s: dict, console=None) -> None:
    """Rich table of a check summary (to stderr, so stdout stays machine-readable)."""
    # deferred: rich takes ~0.1 s to import, and `dflash-trt --help` imports this module
    from rich.console import Console
    from rich.table import Table

    t = Table(
        title=f"dflash-trt build: {s['backend']} backend, {s['sm']}, "
        f"KV cache {s['kv_cache']} for {s['max_batch']} x {s['max_seq_len']} tokens"
    )
    for col in ("model", "params", "bf16", "fp8", "nvfp4", "KV cache"):
        t.add_column(col, justify="left" if col == "model" else "right")
    for name in ("target", "drafter"):
        m = s[name]
        mem = [(_gib(m["bytes"][p]) + (" *" if p == m["quant"] else "")) for p in ("bf16", "fp8", "nvfp4")]
        t.add_row(
            f"{name} ({m.get('model_type', 'dflash')}, {m['layers']} layers)",
            f"{m['params'] / 1e6:.1f} M",
            *mem,
            _gib(m["kv_cache_bytes"]),
        )
    d = s["drafter"]
    t.caption = (
        f"* = chosen precision (embeddings, norms, lm_head stay bf16). Drafter block size {d['block_size']}, "
        f"taps {d['target_layer_ids']}, mask token {d['mask_token_id']}."
    )
    (console or Console(stderr=True)).print(t)
