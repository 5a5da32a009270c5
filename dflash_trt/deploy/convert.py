"""Hugging Face target / DFlash drafter -> TensorRT-LLM 1.2 checkpoint folders (and back, for tests).

Boundary: pure tensor work plus atomic file writes; no TensorRT-LLM import. A checkpoint folder is
  config.json            PretrainedConfig.to_dict() layout (architecture, dtype, shape fields,
                         mapping {world_size, tp_size, pp_size}, quantization {quant_algo, ...})
  rank{N}.safetensors    TensorRT-LLM weight names, tensor-parallel shard N
Names (tensorrt_llm/models/{llama,qwen}/convert.py): transformer.vocab_embedding.weight;
transformer.layers.{i}.{input_layernorm, post_layernorm}.weight; .attention.qkv (fused q|k|v
rows, per rank: q, k and v each split by heads, then fused), .attention.dense (o_proj),
.attention.{q,k}_layernorm.weight (Qwen3), .mlp.fc (gate_proj: the activated branch), .mlp.gate
(up_proj), .mlp.proj (down_proj); transformer.ln_f.weight; lm_head.weight (vocab-parallel, padded
to a multiple of tp_size). Column-parallel: qkv, fc, gate, lm_head; row-parallel: dense, proj.
The drafter uses the same layer names plus transformer.fc (column-parallel, output gathered),
transformer.hidden_norm; its final norm is transformer.ln_f; it has no embedding or lm_head
(the target's are shared). Per-layer tensors of one linear: see tp.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflash_trt.atomic import atomic_dir
from dflash_trt.config import DrafterConfig
from dflash_trt.deploy import tp as T
from dflash_trt.deploy.hf_checkpoint import QUANT_CONFIG_NAME, unshared
from dflash_trt.deploy.quantize import algo_of, make_hf_quant_config, quantize_state_dict
from dflash_trt.errors import CheckpointError, ConfigError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
FAMILIES = ("qwen2", "qwen3", "llama")
DRAFTER_ARCH = "DFlashDraftModel"
LINEAR_LEAVES = ("qkv", "dense", "fc", "gate", "proj", "lm_head")
ROW_PARALLEL = ("dense", "proj")


def _get(cfg, key, default=None):
    v = cfg.get(key) if isinstance(cfg, dict) else getattr(cfg, key, None)
    return default if v is None else v


def _rope(cfg) -> tuple[float, dict | None]:
    """rope base and non-default scaling of a transformers (v4 or v5) or z-lab config."""
    rp = _get(cfg, "rope_parameters", {}) or {}
    theta = float(rp.get("rope_theta", _get(cfg, "rope_theta", 10000.0)))
    scaling = _get(cfg, "rope_scaling")
    if rp.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return theta, scaling


def _read_source(src, what: str) -> tuple[dict, object, dict | None]:
    """(state_dict, config, hf_quant_config | None) from a folder or a (state_dict, config) tuple."""
    if isinstance(src, (str, Path)):
        folder = Path(src)
        if not (folder / "config.json").is_file():
            raise CheckpointError(f"{what} {folder}: no config.json; expected a Hugging Face model folder")
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{what} {folder}: no *.safetensors weight files")
        state: dict = {}
        for f in files:
            state.update(load_file(str(f)))
        qpath = folder / QUANT_CONFIG_NAME
        return (
            state,
            json.loads((folder / "config.json").read_text()),
            (json.loads(qpath.read_text()) if qpath.is_file() else None),
        )
    if isinstance(src, tuple) and len(src) == 2:
        state, cfg = src
        if hasattr(cfg, "to_json_dict"):  # DrafterConfig
            cfg = cfg.to_json_dict()
        return dict(state), cfg, None
    raise ConfigError(f"{what} source: pass a folder path or a (state_dict, config) tuple, not {type(src).__name__}")


def _resolve_quant(state, hf_qc, quant, act_amax, kv_cache):
    """-> (state, quant_algo, kv_cache_quant_algo). quant: None | 'fp8' | 'fp8_per_channel' | 'nvfp4'
    (quantise now) | an hf_quant_config dict describing an already quantised state dict."""
    if isinstance(quant, dict):
        hf_qc = quant
    elif algo_of(quant) is not None:
        if hf_qc is not None:
            have = hf_qc.get("quantization", {}).get("quant_algo")
            if have != algo_of(quant):
                raise ConfigError(
                    f"quant={quant}: the source is already quantised as {have}; pass quant=None to keep "
                    f"it, or convert the unquantised model"
                )
        else:
            state, hf_qc = quantize_state_dict(state, quant, act_amax=act_amax, kv_cache=kv_cache)
    q = (hf_qc or make_hf_quant_config(None, None))["quantization"]
    kv = q.get("kv_cache_quant_algo") or (None if kv_cache in (None, "none") else str(kv_cache).upper())
    if kv not in (None, "FP8"):
        raise ConfigError(f"quantization.kv_cache={kv_cache}: unknown; use none or fp8")
    return state, q.get("quant_algo"), kv


class _Reader:
    """Reads tensors from an HF state dict and remembers which were used (leftovers are an error)."""

    def __init__(self, state: dict):
        self.state, self.used = state, set()

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self.state:
            raise ConfigError(f"state dict has no {name}: does the config match the weights?")
        self.used.add(name)
        return self.state[name]

    def linear(self, module: str) -> T.QLinear:
        lin = T.from_hf(self.state, module)
        self.used.update(k for k in self.state if k.startswith(module + ".") and "." not in k[len(module) + 1 :])
        return lin

    def check_all_used(self, what: str) -> None:
        left = [k for k in self.state if k not in self.used and not k.endswith("rotary_emb.inv_freq")]
        if left:
            raise ConfigError(
                f"{what}: tensor {left[0]} ({len(left)} in all) has no TensorRT-LLM mapping; "
                f"unsupported architecture feature"
            )


def _shape(cfg) -> dict:
    nh = int(_get(cfg, "num_attention_heads"))
    d = int(_get(cfg, "hidden_size"))
    return dict(
        hidden=d,
        inter=int(_get(cfg, "intermediate_size")),
        layers=int(_get(cfg, "num_hidden_layers")),
        heads=nh,
        kv_heads=int(_get(cfg, "num_key_value_heads", nh)),
        head_dim=int(_get(cfg, "head_dim", d // nh)),
        vocab=int(_get(cfg, "vocab_size")),
    )


def _check_tp(shp: dict, tp: int) -> None:
    if tp < 1:
        raise ConfigError(f"tp_size={tp}: must be >= 1")
    for field, n in (
        ("num_attention_heads", shp["heads"]),
        ("intermediate_size", shp["inter"]),
        ("hidden_size", shp["hidden"]),
    ):
        if n % tp:
            raise ConfigError(f"tp_size={tp} does not divide {field}={n}; choose a tp_size that does")
    kv = shp["kv_heads"]
    if kv % tp and tp % kv:
        raise ConfigError(f"tp_size={tp} and num_key_value_heads={kv}: one must divide the other")


def _layer(rd: _Reader, hp: str, tn: str, shp: dict, tp: int, rank: int, dtype, qk_norm: bool, kv_fp8: bool) -> dict:
    """One decoder layer's rank-`rank` shard: hp = HF prefix ('model.layers.3.'), tn = TRT prefix."""
    q, k, v = (rd.linear(f"{hp}self_attn.{x}_proj") for x in "qkv")
    if shp["kv_heads"] < tp:
        k, v = T.dup_kv_heads(k, shp["kv_heads"], tp), T.dup_kv_heads(v, shp["kv_heads"], tp)
    out = T.to_trt(T.cat_rows([T.split_column(x, tp, rank) for x in (q, k, v)]), tn + "attention.qkv.", dtype)
    out |= T.to_trt(T.split_row(rd.linear(hp + "self_attn.o_proj"), tp, rank), tn + "attention.dense.", dtype)
    out |= T.to_trt(T.split_column(rd.linear(hp + "mlp.gate_proj"), tp, rank), tn + "mlp.fc.", dtype)
    out |= T.to_trt(T.split_column(rd.linear(hp + "mlp.up_proj"), tp, rank), tn + "mlp.gate.", dtype)
    out |= T.to_trt(T.split_row(rd.linear(hp + "mlp.down_proj"), tp, rank), tn + "mlp.proj.", dtype)
    out[tn + "input_layernorm.weight"] = rd.tensor(hp + "input_layernorm.weight").to(dtype)
    out[tn + "post_layernorm.weight"] = rd.tensor(hp + "post_attention_layernorm.weight").to(dtype)
    if qk_norm:
        out[tn + "attention.q_layernorm.weight"] = rd.tensor(hp + "self_attn.q_norm.weight").to(dtype)
        out[tn + "attention.k_layernorm.weight"] = rd.tensor(hp + "self_attn.k_norm.weight").to(dtype)
    if kv_fp8:  # no calibrated KV amax: modelopt's recommended default scale of 1.0
        out[tn + "attention.kv_cache_scaling_factor"] = torch.ones(1, dtype=torch.float32)
    return out


def _trt_config(arch: str, shp: dict, cfg, tp: int, dtype: str, algo, kv_algo, exclude: list, **extra) -> dict:
    theta, scaling = _rope(cfg)
    return {
        "architecture": arch,
        "dtype": dtype,
        "logits_dtype": "float32",
        "vocab_size": shp["vocab"],
        "hidden_size": shp["hidden"],
        "num_hidden_layers": shp["layers"],
        "num_attention_heads": shp["heads"],
        "num_key_value_heads": shp["kv_heads"],
        "head_size": shp["head_dim"],
        "intermediate_size": shp["inter"],
        "hidden_act": _get(cfg, "hidden_act", "silu"),
        "norm_epsilon": float(_get(cfg, "rms_norm_eps", 1e-6)),
        "position_embedding_type": "rope_gpt_neox",
        "max_position_embeddings": int(_get(cfg, "max_position_embeddings", 32768)),
        "rotary_embedding_dim": shp["head_dim"],
        "rotary_base": theta,
        "rotary_scaling": scaling,
        "mapping": {"world_size": tp, "tp_size": tp, "pp_size": 1, "cp_size": 1},
        "quantization": {
            "quant_algo": algo,
            "kv_cache_quant_algo": kv_algo,
            "group_size": 16 if algo == "NVFP4" else 128,
            "smoothquant_val": 0.5,
            "clamp_val": None,
            "use_meta_recipe": False,
            "has_zero_point": False,
            "pre_quant_scale": False,
            "exclude_modules": exclude if algo else None,
        },
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        **extra,
    }


def _plain_linears(weights: dict) -> list[str]:
    """TRT-LLM linear modules left in high precision (the exclude_modules of a quantised checkpoint)."""
    return [
        k[: -len(".weight")]
        for k, v in weights.items()
        if k.endswith(".weight")
        and k.rsplit(".", 2)[-2] in LINEAR_LEAVES
        and v.is_floating_point()
        and v.dtype != torch.float8_e4m3fn
    ]


def _write(out_dir, config: dict, ranks: list[dict]) -> Path:
    with atomic_dir(out_dir) as tmp:
        for r, w in enumerate(ranks):
            save_file(unshared(w), str(tmp / f"rank{r}.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=4) + "\n")
    return Path(out_dir)


def _dtype(dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype}: unsupported; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def convert_target(
    src,
    out_dir,
    tp_size: int = 1,
    dtype: str = "bfloat16",
    quant=None,
    act_amax: dict | None = None,
    kv_cache: str | None = None,
) -> Path:
    """HF Qwen2 / Qwen3 / Llama target (folder, or (state_dict, transformers config or dict)) ->
    TensorRT-LLM checkpoint in out_dir. quant: None | 'fp8' | 'fp8_per_channel' | 'nvfp4' |
    hf_quant_config dict (state already quantised; a folder's hf_quant_config.json is used too)."""
    state, cfg, hf_qc = _read_source(src, "target")
    family = _get(cfg, "model_type")
    if family not in FAMILIES:
        raise ConfigError(f"target model_type={family}: unsupported; supported: {', '.join(FAMILIES)}")
    state, algo, kv_algo = _resolve_quant(state, hf_qc, quant, act_amax, kv_cache)
    shp, tdt = _shape(cfg), _dtype(dtype)
    _check_tp(shp, tp_size)
    if "lm_head.weight_scale" in state:
        raise ConfigError("lm_head is quantised: keep it in high precision (exclude_modules: ['lm_head'])")
    ranks = []
    for rank in range(tp_size):
        rd = _Reader(state)
        embed = rd.tensor("model.embed_tokens.weight")
        w = {"transformer.vocab_embedding.weight": embed.to(tdt)}
        for i in range(shp["layers"]):
            w |= _layer(
                rd,
                f"model.layers.{i}.",
                f"transformer.layers.{i}.",
                shp,
                tp_size,
                rank,
                tdt,
                family == "qwen3",
                kv_algo == "FP8",
            )
        w["transformer.ln_f.weight"] = rd.tensor("model.norm.weight").to(tdt)
        lm = rd.tensor("lm_head.weight") if "lm_head.weight" in state else embed  # tied embeddings
        pad = -shp["vocab"] % tp_size
        if pad:
            lm = torch.cat([lm, lm.new_zeros(pad, lm.shape[1])])
        w["lm_head.weight"] = lm.chunk(tp_size, dim=0)[rank].to(tdt)
        rd.check_all_used("target")
        ranks.append(w)
    arch = (
        _get(cfg, "architectures")
        or [{"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}[family]]
    )[0]
    extra = {
        "qk_layernorm": family == "qwen3",
        "mlp_bias": bool(_get(cfg, "mlp_bias", False)),
        "attn_bias": family == "qwen2" or bool(_get(cfg, "attention_bias", False)),
        "tie_word_embeddings": bool(_get(cfg, "tie_word_embeddings", False)),
    }
    if family in ("qwen2", "qwen3"):
        extra |= {
            "qwen_type": family,
            "seq_length": int(_get(cfg, "seq_length", 8192)),
            "use_logn_attn": False,
            "disable_weight_only_quant_plugin": False,
        }
    config = _trt_config(arch, shp, cfg, tp_size, dtype, algo, kv_algo, _plain_linears(ranks[0]), **extra)
    return _write(out_dir, config, ranks)


def convert_drafter(
    src,
    out_dir,
    tp_size: int = 1,
    dtype: str = "bfloat16",
    quant=None,
    act_amax: dict | None = None,
    kv_cache: str | None = None,
) -> Path:
    """DFlash drafter (z-lab folder, or (state_dict, config dict | DrafterConfig)) -> TensorRT-LLM
    style checkpoint (architecture DFlashDraftModel) in out_dir. quant as in convert_target."""
    state, cfg, hf_qc = _read_source(src, "drafter")
    dc = _get(cfg, "dflash_config", {}) or {}
    missing = [k for k in ("block_size", "num_target_layers") if _get(cfg, k) is None]
    missing += [f"dflash_config.{k}" for k in ("mask_token_id", "target_layer_ids") if k not in dc]
    if missing:
        raise ConfigError(f"drafter config lacks {', '.join(missing)}: is this a z-lab DFlash drafter config?")
    beyond = DrafterConfig.from_json_dict(cfg).beyond_paper()  # also refuses DFlash 2 and unknown fields
    if beyond:  # the TensorRT-LLM drafter is the paper's: it would build an engine that drafts wrongly
        raise ConfigError(
            f"drafter config sets {', '.join(beyond)}: the TensorRT-LLM drafter does not implement "
            f"them; serve this drafter with the PyTorch engine"
        )
    state, algo, kv_algo = _resolve_quant(state, hf_qc, quant, act_amax, kv_cache)
    shp, tdt = _shape(cfg), _dtype(dtype)
    _check_tp(shp, tp_size)
    ranks = []
    for rank in range(tp_size):
        rd = _Reader(state)
        w = T.to_trt(T.split_column(rd.linear("fc"), tp_size, rank), "transformer.fc.", tdt)
        w["transformer.hidden_norm.weight"] = rd.tensor("hidden_norm.weight").to(tdt)
        for i in range(shp["layers"]):
            w |= _layer(rd, f"layers.{i}.", f"transformer.layers.{i}.", shp, tp_size, rank, tdt, True, kv_algo == "FP8")
        w["transformer.ln_f.weight"] = rd.tensor("norm.weight").to(tdt)
        rd.check_all_used("drafter")
        ranks.append(w)
    ids = [int(i) for i in dc["target_layer_ids"]]
    config = _trt_config(
        DRAFTER_ARCH,
        shp,
        cfg,
        tp_size,
        dtype,
        algo,
        kv_algo,
        _plain_linears(ranks[0]),
        qk_layernorm=True,
        mlp_bias=False,
        attn_bias=bool(_get(cfg, "attention_bias", False)),
        block_size=int(_get(cfg, "block_size")),
        mask_token_id=int(dc["mask_token_id"]),
        target_layer_ids=ids,
        num_target_layers=int(_get(cfg, "num_target_layers")),
        fc_in_features=len(ids) * shp["hidden"],
    )
    return _write(out_dir, config, ranks)


def _merge_qkv(lins: list[T.QLinear], cfg: dict, tp: int) -> T.QLinear:
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_size"]
    kv_local = max(nkv // tp, 1)
    parts = [T.split_heads(x, [nh // tp * hd, kv_local * hd, kv_local * hd]) for x in lins]
    # with duplicated KV heads (nkv < tp) ranks h*reps .. (h+1)*reps-1 hold copies of head h
    kv_ranks = range(tp) if nkv >= tp else [h * (tp // nkv) for h in range(nkv)]
    q = T.cat_rows([p[0] for p in parts])
    k, v = (T.cat_rows([parts[r][j] for r in kv_ranks]) for j in (1, 2))
    return T.cat_rows([q, k, v])


def merge_ranks(out_dir) -> dict[str, torch.Tensor]:
    """Inverse of the tensor-parallel split: the full (tp_size=1 equivalent) TensorRT-LLM state
    dict of a checkpoint folder. Replicated tensors must agree across ranks."""
    folder = Path(out_dir)
    cfg = json.loads((folder / "config.json").read_text())
    tp = int(cfg["mapping"]["tp_size"])
    files = [folder / f"rank{r}.safetensors" for r in range(tp)]
    if not all(f.is_file() for f in files):
        raise CheckpointError(f"{folder}: expected rank0..rank{tp - 1}.safetensors for tp_size={tp}")
    ranks = [load_file(str(f)) for f in files]
    if any(set(r) != set(ranks[0]) for r in ranks):
        raise CheckpointError(f"{folder}: ranks hold different tensor names")
    prefixes = sorted(
        {k[: -len("weight")] for k in ranks[0] if k.endswith(".weight") and k.rsplit(".", 2)[-2] in LINEAR_LEAVES}
    )
    out: dict[str, torch.Tensor] = {}
    for p in prefixes:
        lins = [T.from_trt(r, p) for r in ranks]
        leaf = p[:-1].rsplit(".", 1)[-1]
        merged = (
            _merge_qkv(lins, cfg, tp)
            if leaf == "qkv"
            else T.cat_cols(lins) if leaf in ROW_PARALLEL else T.cat_rows(lins)
        )
        if p == "lm_head.":
            merged = merged.replace(weight=merged.weight[: cfg["vocab_size"]])
        out |= T.to_trt(merged, p)
    for k, v in ranks[0].items():
        if k in out or any(k.startswith(p) and k[len(p) :].count(".") == 0 for p in prefixes):
            continue
        if any(not torch.equal(r[k], v) for r in ranks[1:]):
            raise CheckpointError(f"{folder}: replicated tensor {k} differs between ranks")
        out[k] = v
    return out
