"""Quantise a drafter's state dict to NVIDIA Model Optimizer's HF export layout, and any such checkpoint back.

What is ours and why (the target's quantized checkpoint is Model Optimizer's own export, made by
deploy/modelopt_target.py): (1) the drafter -- modelopt's export_hf_checkpoint takes transformers models, and
the drafter's calibration needs the pair running real DFlash decoding, so its FP8 / NVFP4 weights, input
scales and K/V scales are written here in modelopt's layout (tests/test_quantize.py checks our formats against
modelopt's QTensors bit for bit, test_kv_scales.py the K/V scales against its postprocess_state_dict);
(2) reading a modelopt checkpoint back for dflash-trt's torch engine (dequantize_state_dict: CPU simulation;
modeling/lowp_linear.py runs FP8 natively on sm_89+ GPUs); (3) the GPU-generation checks of a build.

Boundary: state-dict level. Decides which tensors are quantised (the Linear weights of decoder
layers: q/k/v/o_proj, gate/up/down_proj, and the DFlash drafter's `fc`; norms, embeddings and
lm_head stay in high precision), computes scales with the number formats of formats.py, writes the
modelopt tensor names and hf_quant_config.json content, and dequantises for the CPU simulation
path. Also: the drafter's activation and K/V amax calibration hooks and the GPU-generation checks. File I/O in
hf_checkpoint.py, which builds on this module.

Layout per quantised linear `<m>` (modelopt unified HF export):
  FP8                        <m>.weight fp8 [out,in], <m>.weight_scale f32 [], <m>.input_scale f32 []
  FP8_PER_CHANNEL_PER_TOKEN  <m>.weight fp8 [out,in], <m>.weight_scale f32 [out] (dynamic activations)
  NVFP4                      <m>.weight uint8 [out,in/2], <m>.weight_scale fp8 [out,in/16],
                             <m>.weight_scale_2 f32 [], <m>.input_scale f32 []
Like modelopt's fusion preprocessing, layers that TensorRT-LLM fuses (q|k|v, and gate|up) share
their input_scale and their per-tensor weight scale (FP8 weight_scale, NVFP4 weight_scale_2).
FP8 KV cache (kv_cache_quant_algo FP8), per attention layer `<a>` = `<prefix>layers.<i>.self_attn`:
  <a>.k_proj.k_scale f32 [], <a>.v_proj.v_scale f32 [] = max |K| / 448, max |V| / 448 over the
  calibration forwards, K after k_norm and RoPE (the tensors the cache holds), as modelopt's HF
  export writes its k/v_bmm_quantizer amax (torch/export/quant_utils.py _KV_CACHE_REPLACEMENTS).
"""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn
from tqdm.auto import tqdm

from dflash_trt.deploy import formats as F
from dflash_trt.errors import ConfigError

PRODUCER = {"name": "dflash_trt", "version": "0.1.0"}
ALGOS = {"fp8": "FP8", "fp8_per_channel": "FP8_PER_CHANNEL_PER_TOKEN", "nvfp4": "NVFP4"}
_ALGO_OF = {**ALGOS, **{v.lower(): v for v in ALGOS.values()}}
STATIC_ACT = {"FP8", "NVFP4"}  # algorithms whose activations need a calibrated input_scale
SM_ARCHS = {"sm_90": "Hopper", "sm_100": "Blackwell", "sm_120": "Blackwell"}
DEFAULT_EXCLUDE = ("lm_head",)

# <prefix>layers.<i>.self_attn.{q,k,v,o}_proj / mlp.{gate,up,down}_proj, or the drafter's fc.
_QUANTIZABLE = re.compile(
    r"^(?:(?P<layer>(?:.*\.)?layers\.\d+)\.(?:self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)" r"|(?:.*\.)?fc)$"
)
_FUSED = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))
_ATTENTION = re.compile(r"^(?:.*\.)?layers\.\d+\.self_attn$")  # layers whose K/V go to the KV cache


def algo_of(fmt: str | None) -> str | None:
    """'fp8' | 'fp8_per_channel' | 'nvfp4' (or modelopt's upper-case names) -> quant_algo; None/'none' -> None."""
    if fmt is None or str(fmt).lower() in ("none", "bf16", "bfloat16", "fp16", ""):
        return None
    algo = _ALGO_OF.get(str(fmt).lower())
    if algo is None:
        raise ConfigError(f"quantization.weights={fmt}: unknown; use one of none, {', '.join(ALGOS)}")
    return algo


def check_quant_target(fmt: str | None, sm: str, kv_cache: str | None = None) -> None:
    """Raise ConfigError (one line naming the field) when the format cannot run on `sm`."""
    if sm not in SM_ARCHS:
        raise ConfigError(f"gpu_arch={sm}: unsupported; use sm_90 (Hopper), sm_100 or sm_120 (Blackwell)")
    algo = algo_of(fmt)
    if algo == "NVFP4" and SM_ARCHS[sm] != "Blackwell":
        raise ConfigError(
            f"quantization.weights={fmt} needs Blackwell (sm_100/sm_120); " f"gpu_arch={sm} is {SM_ARCHS[sm]}: use fp8"
        )
    if kv_cache is not None and str(kv_cache).lower() not in ("none", "fp8"):
        raise ConfigError(f"quantization.kv_cache={kv_cache}: unknown; use none or fp8")


def check_kv_cache(target_fmt: str | None, kv_cache: str | None) -> None:
    """An fp8 KV cache needs a quantised target: its calibrated k/v scales ship inside the Model
    Optimizer checkpoint, and a KV-only one (quant_algo null) is refused by vLLM and SGLang, so a
    bf16 target's fp8 cache would run at the engines' uncalibrated default scale 1.0."""
    if kv_cache is not None and str(kv_cache).lower() == "fp8" and algo_of(target_fmt) is None:
        raise ConfigError(
            f"kv_cache=fp8 with target_quant={target_fmt}: the calibrated KV-cache scales ship in a quantised "
            f"checkpoint; set target_quant: fp8 (or nvfp4), or kv_cache: bf16"
        )


def kv_scale_names(attention: str) -> tuple[str, str]:
    """Attention module `<prefix>layers.<i>.self_attn` -> its (k_scale, v_scale) tensor names."""
    return f"{attention}.k_proj.k_scale", f"{attention}.v_proj.v_scale"


def attention_modules(names: Iterable[str]) -> list[str]:
    """Attention modules of a state dict: those with a `<a>.k_proj.weight` (target and drafter alike)."""
    suffix = ".k_proj.weight"
    return [n[: -len(suffix)] for n in names if n.endswith(suffix) and _ATTENTION.match(n[: -len(suffix)])]


def quantizable_modules(names: Iterable[str]) -> list[str]:
    """Module names (tensor name without '.weight') whose weight gets quantised."""
    return [n[: -len(".weight")] for n in names if n.endswith(".weight") and _QUANTIZABLE.match(n[: -len(".weight")])]


def is_excluded(module: str, exclude: Iterable[str]) -> bool:
    """fnmatch patterns (modelopt's exclude_modules style: 'lm_head', 'model.layers.0.*')."""
    return any(module == p or fnmatch.fnmatchcase(module, p) for p in exclude)


def _fusion_groups(modules: list[str]) -> list[list[str]]:
    """Partition modules into the groups TensorRT-LLM fuses (q|k|v, gate|up); others alone."""
    present, seen, groups = set(modules), set(), []
    for m in modules:
        if m in seen:
            continue
        group = [m]
        layer = _QUANTIZABLE.match(m).group("layer")
        if layer:
            for names in _FUSED:
                full = [f"{layer}.{n}" for n in names]
                if m in full:
                    group = [x for x in full if x in present]
        seen.update(group)
        groups.append(group)
    return groups


def make_hf_quant_config(
    algo: str | None, kv_cache_quant_algo: str | None = None, exclude: Iterable[str] = DEFAULT_EXCLUDE
) -> dict:
    """hf_quant_config.json content in modelopt's layout."""
    q: dict = {"quant_algo": algo, "kv_cache_quant_algo": kv_cache_quant_algo}
    if algo == "NVFP4":
        q["group_size"] = F.NVFP4_BLOCK
    q["exclude_modules"] = list(dict.fromkeys(exclude))
    return {"producer": dict(PRODUCER), "quantization": q}


def hf_quantization_config(hf_quant_config: dict) -> dict:
    """config.json `quantization_config` as modelopt's export writes it (compressed-tensors style
    config_groups, ignore, quant_algo, kv_cache_scheme, producer, quant_method 'modelopt')."""
    q = hf_quant_config.get("quantization", {})
    algo, out = q.get("quant_algo"), {}
    fp8 = {"dynamic": False, "num_bits": 8, "type": "float"}
    if algo == "FP8":
        out["config_groups"] = {
            "group_0": {"input_activations": dict(fp8), "weights": dict(fp8), "targets": ["Linear"]}
        }
    elif algo == "FP8_PER_CHANNEL_PER_TOKEN":
        out["config_groups"] = {
            "group_0": {
                "input_activations": dict(fp8),
                "targets": ["Linear"],
                "weights": {**fp8, "strategy": "channel"},
            }
        }
    elif algo == "NVFP4":
        gs = q.get("group_size", F.NVFP4_BLOCK)
        fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": gs}
        out["config_groups"] = {
            "group_0": {"input_activations": dict(fp4), "weights": dict(fp4), "targets": ["Linear"]}
        }
    out["ignore"] = list(q.get("exclude_modules") or [])
    if algo:
        out["quant_algo"] = algo
    kv = q.get("kv_cache_quant_algo")
    if kv:
        out["kv_cache_scheme"] = dict(fp8) if kv == "FP8" else kv
    if "producer" in hf_quant_config:
        out["producer"] = hf_quant_config["producer"]
    out["quant_method"] = "modelopt"
    return out


def quantize_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    fmt: str,
    exclude: Iterable[str] = DEFAULT_EXCLUDE,
    act_amax: Mapping[str, float] | None = None,
    kv_cache: str | None = None,
    kv_amax: Mapping[str, tuple[float, float]] | None = None,
) -> tuple[dict[str, torch.Tensor], dict]:
    """Quantise the decoder-layer Linear weights of an HF (or drafter) state dict.

    state_dict: name -> tensor (Linear weights [out, in]); fmt: 'fp8' | 'fp8_per_channel' | 'nvfp4';
    exclude: module-name patterns kept in high precision (also listed in exclude_modules);
    act_amax: module name -> calibrated max |input| (calibrate_amax); without it no input_scale
    is written (fine for dequantised simulation; TensorRT-LLM FP8/NVFP4 builds need it);
    kv_cache: None | 'fp8' (sets kv_cache_quant_algo); kv_amax: attention module -> (max |K|,
    max |V|) (calibrate_amax(kv=True)); with kv_cache 'fp8' it writes every attention layer's
    k_scale / v_scale. Returns (qstate, hf_quant_config).
    """
    algo = algo_of(fmt)
    if algo is None:
        raise ConfigError(f"quantization.weights={fmt}: nothing to quantise; use one of {', '.join(ALGOS)}")
    kv_algo = None if kv_cache is None or str(kv_cache).lower() == "none" else str(kv_cache).upper()
    if kv_algo not in (None, "FP8"):
        raise ConfigError(f"quantization.kv_cache={kv_cache}: unknown; use none or fp8")
    exclude = list(exclude)
    modules = [m for m in quantizable_modules(state_dict) if not is_excluded(m, exclude)]
    out = {k: v for k, v in state_dict.items()}
    for group in _fusion_groups(modules):
        ws = [state_dict[f"{m}.weight"].detach() for m in group]
        if algo == "NVFP4":
            shared = max(F.nvfp4_global_scale(w) for w in ws)  # one global amax for the fused layer
        elif algo == "FP8":
            shared = max(F.fp8_scale(w) for w in ws)
        in_scale = None
        if act_amax is not None and algo in STATIC_ACT:
            missing = [m for m in group if m not in act_amax]
            if missing:
                raise ConfigError(
                    f"act_amax has no entry for {missing[0]}: the calibration run never reached "
                    f"it; calibrate with prompts that run every layer, or exclude it"
                )
            in_scale = F.input_scale_from_amax(max(float(act_amax[m]) for m in group), algo)
        for m, w in zip(group, ws):
            if algo == "NVFP4":
                try:
                    packed, bs, gs = F.nvfp4_quantize(w, shared)
                    out[f"{m}.weight"], out[f"{m}.weight_scale"], out[f"{m}.weight_scale_2"] = packed, bs, gs
                except ValueError as e:
                    raise ConfigError(f"{m}.weight: {e}") from None
            else:
                scale = shared if algo == "FP8" else F.fp8_scale(w, per_channel=True)
                out[f"{m}.weight"], out[f"{m}.weight_scale"] = F.fp8_quantize(w, scale), scale.float()
            if in_scale is not None:
                out[f"{m}.input_scale"] = in_scale.clone()
    if kv_algo == "FP8" and kv_amax is not None:
        out.update(kv_scales(attention_modules(state_dict), kv_amax))
    return out, make_hf_quant_config(algo, kv_algo, exclude)


def kv_scales(attentions: Iterable[str], kv_amax: Mapping[str, tuple[float, float]]) -> dict[str, torch.Tensor]:
    """{<a>.k_proj.k_scale, <a>.v_proj.v_scale: amax / 448 as float32 []} for every attention module.
    No clamp to >= 1: modelopt's HF export divides by 448 only (its TensorRT-LLM-checkpoint path clamps)."""
    out = {}
    for a in attentions:
        if a not in kv_amax:
            raise ConfigError(
                f"kv_amax has no entry for {a}: the calibration run never reached it; calibrate with "
                f"calibrate_amax(..., kv=True) on prompts that run every layer"
            )
        for name, amax in zip(kv_scale_names(a), kv_amax[a]):
            out[name] = F.input_scale_from_amax(float(amax), "FP8")  # a zero amax gets 1, never a 0 scale
    return out


def unquantized_modules(qstate: Mapping[str, torch.Tensor]) -> list[str]:
    """exclude_modules of a quantized drafter: lm_head (an engine may add the shared head's rows to the serving
    copy) and every module holding a matrix that was not quantized (Markov / confidence heads, GRU,
    convolution kernels, selector, embeddings). vLLM builds every linear it has a quant_config for as a
    quantized layer unless exclude_modules names it (layers/quantization/modelopt.py is_layer_excluded), so a
    bf16 linear missing here loads as garbage."""
    done = set(quantized_modules(qstate))
    out = {"lm_head"}
    for k, v in qstate.items():
        module = k.rpartition(".")[0]
        if v.dim() >= 2 and module and module not in done:
            out.add(module)
    return sorted(out)


def quantized_modules(qstate: Mapping[str, torch.Tensor]) -> list[str]:
    """Modules of a quantised state dict (those with a `<m>.weight_scale`)."""
    return [k[: -len(".weight_scale")] for k in qstate if k.endswith(".weight_scale")]


def dequantize_state_dict(
    qstate: Mapping[str, torch.Tensor], hf_quant_config: dict, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Inverse of quantize_state_dict for simulation: quantised weights become `dtype` tensors
    [out, in]; scale tensors are dropped; every other tensor is passed through unchanged."""
    algo = hf_quant_config.get("quantization", {}).get("quant_algo")
    if algo not in (None, *ALGOS.values()):
        raise ConfigError(
            f"hf_quant_config.json quantization.quant_algo={algo}: unsupported; "
            f"supported: {', '.join(ALGOS.values())}"
        )
    mods = set(quantized_modules(qstate))
    out = {}
    for k, v in qstate.items():
        m, _, leaf = k.rpartition(".")
        if m in mods and leaf in ("weight_scale", "weight_scale_2", "input_scale"):
            continue
        if leaf in ("k_scale", "v_scale"):  # KV-cache scales: the simulation keeps K/V in full precision
            continue
        if m in mods and leaf == "weight":
            if v.dtype == torch.uint8:
                if f"{m}.weight_scale_2" not in qstate:
                    raise ConfigError(f"{m}.weight is packed NVFP4 but {m}.weight_scale_2 is missing")
                v = F.nvfp4_dequantize(v, qstate[f"{m}.weight_scale"], qstate[f"{m}.weight_scale_2"], dtype)
            else:
                v = F.fp8_dequantize(v, qstate[f"{m}.weight_scale"], dtype)
        out[k] = v
    return out


def _record_kv(model: nn.Module, record: Callable[[str, torch.Tensor, torch.Tensor], None]) -> list[Callable]:
    """Route the K/V of every attention layer of the dflash_trt drafter to record(name, k, v): its `kv`
    method is wrapped (context injection and the drafted block both go through it); returns the undo
    steps. A transformers target's K/V scales are Model Optimizer's (deploy/modelopt_target.py)."""
    undo = []
    for name, mod in model.named_modules():
        if not _ATTENTION.match(name) or not callable(getattr(mod, "kv", None)):
            continue
        rec = functools.partial(record, name)

        def kv(*a, _kv=mod.kv, _rec=rec, **kw):
            k, v = _kv(*a, **kw)
            _rec(k, v)
            return k, v

        mod.kv = kv  # an instance attribute shadows the method until deleted
        undo.append(functools.partial(delattr, mod, "kv"))
    return undo


@torch.no_grad()
def calibrate_amax(
    model: nn.Module,
    run_one: Callable[[object], object],
    prompts: Iterable,
    progress: bool = True,
    only_quantizable: bool = True,
    kv: bool = False,
) -> tuple[dict[str, float], dict[str, tuple[float, float]]]:
    """Run `run_one(prompt)` (which runs `model` on one calibration prompt or batch) for every prompt,
    with forward-pre-hooks on the model's nn.Linear layers that record max |input|, and with kv=True
    the max |K| and |V| each attention layer writes to its KV cache. Returns (act_amax: module name
    -> amax, kv_amax: attention module name -> (k amax, v amax)), quantize_state_dict's inputs."""
    amax: dict[str, float] = {}
    kv_amax: dict[str, tuple[float, float]] = {}
    hooks = []

    def hook(name):
        def fn(_mod, args):
            x = args[0] if args else None
            if isinstance(x, torch.Tensor) and x.numel():
                amax[name] = max(amax.get(name, 0.0), float(x.detach().abs().amax()))

        return fn

    def record_kv(name: str, k: torch.Tensor, v: torch.Tensor) -> None:  # k, v: [R, H_kv, S, D]
        if k.numel() and v.numel():
            old = kv_amax.get(name, (0.0, 0.0))
            kv_amax[name] = (max(old[0], float(k.detach().abs().amax())), max(old[1], float(v.detach().abs().amax())))

    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and (not only_quantizable or _QUANTIZABLE.match(name)):
            hooks.append(mod.register_forward_pre_hook(hook(name)))
    if not hooks:
        raise ConfigError(
            "calibration: the model has no quantisable nn.Linear layers "
            "(expected names like model.layers.0.self_attn.q_proj)"
        )
    undo = [h.remove for h in hooks]
    try:
        if kv:
            undo += _record_kv(model, record_kv)
            if len(undo) == len(hooks):
                raise ConfigError(
                    "calibration: kv=True but the model has no drafter attention layers (layers.<i>.self_attn "
                    "with a kv method); calibrate without kv"
                )
        prompts = list(prompts)
        for p in tqdm(prompts, desc="calibrating activations", disable=not progress or len(prompts) < 2):
            run_one(p)
    finally:
        for u in reversed(undo):
            u()
    return amax, kv_amax


def calibrate_act_amax(
    model: nn.Module,
    run_one: Callable[[object], object],
    prompts: Iterable,
    progress: bool = True,
    only_quantizable: bool = True,
) -> dict[str, float]:
    """calibrate_amax's module name -> max |input| alone (the `act_amax` of quantize_state_dict)."""
    return calibrate_amax(model, run_one, prompts, progress, only_quantizable)[0]
