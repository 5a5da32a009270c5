"""FP8 KV-cache scales (issue #31): calibrated k_scale / v_scale per attention layer, in the layout
NVIDIA Model Optimizer's HF export writes and vLLM / SGLang / TensorRT-LLM read.

What the engines read, and where it is written down (versions: nvidia-modelopt 0.47.0, vLLM 0.33,
SGLang 0.5.23, TensorRT-LLM at NVIDIA/TensorRT-LLM@00bbf71e):
  * names `<prefix>layers.<i>.self_attn.k_proj.k_scale` / `.v_proj.v_scale`: modelopt
    torch/export/quant_utils.py:980-981 (_KV_CACHE_REPLACEMENTS: "k_bmm_quantizer._amax" ->
    "k_proj.k_scale", "v_bmm_quantizer._amax" -> "v_proj.v_scale"; the quantizers sit on the
    attention module, so the prefix is `...self_attn`);
  * value amax / 448 as float32, no clamp: quant_utils.py:1124 (postprocess_state_dict:
    value.float() / maxbound) with unified_export_hf.py:1016 (kv_cache_max_bound = 448); the clamp
    to >= 1 (quant_utils.py:373-407 get_kv_cache_scaling_factor) is on the TensorRT-LLM checkpoint
    path only;
  * amax of K after k_norm and RoPE, V as projected: modelopt
    torch/quantization/plugins/huggingface.py:231-233 (k_bmm_quantizer(key_states) on the tensors
    handed to the attention interface, i.e. what the cache holds);
  * vLLM maps `.self_attn.[kv]_proj.[kv]_scale` -> `.self_attn.attn.[kv]_scale`:
    vllm/model_executor/layers/quantization/base_config.py:233-235 (get_cache_scale_mapper) and
    model_loader/weight_utils.py:1774-1778 (maybe_remap_kv_scale_name); scalars only
    (quantization/kv_cache.py:36-42); a missing scale is 1.0 (kv_cache.py:125-128);
  * vLLM's DFlash drafter loader prepends "model." to the drafter's names
    (model_executor/models/qwen3_dflash.py:866-867) before the same mapper;
  * SGLang: srt/model_loader/weight_utils.py:1816-1833 (same rename, `.self_attn.attn.k_scale`);
  * TensorRT-LLM: tensorrt_llm/_torch/modules/linear.py FP8QDQLinearMethod.load_kv_scales reads the
    "k_scale" / "v_scale" of the k_proj / v_proj weights and keeps their max per fused qkv;
  * hf_quant_config.json `kv_cache_quant_algo: "FP8"` (modelopt quant_utils.py:1716-1718) and
    config.json `kv_cache_scheme: {dynamic: false, num_bits: 8, type: float}`
    (convert_hf_config.py:268-271).
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from conftest import tiny_drafter, tiny_hf, tiny_pair_dir, tiny_target

from dflash_trt.deploy import formats as F
from dflash_trt.deploy.hf_checkpoint import load_quantized_checkpoint, save_quantized_checkpoint
from dflash_trt.deploy.modelopt_target import quantize_target
from dflash_trt.deploy.quantize import (
    calibrate_amax,
    check_kv_cache,
    dequantize_state_dict,
    kv_scale_names,
    quantize_state_dict,
)
from dflash_trt.errors import ConfigError
from dflash_trt.modeling.cache import KVCache

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py

# vLLM base_config.py:232-235, the ModelOpt entry of get_cache_scale_mapper (copied: vLLM is not a
# dependency); SGLang's weight_utils.py:1816-1833 performs the same rename
VLLM_MODELOPT_KV = (re.compile(r"\.self_attn\.[kv]_proj\.([kv])_scale$"), r".self_attn.attn.\1_scale")


def vllm_name(name: str) -> str:
    pattern, repl = VLLM_MODELOPT_KV
    return pattern.sub(repl, name)


def prompts(n=3, length=12, vocab=256, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (1, length), generator=g) for _ in range(n)]


def cache_amax(hf, ids) -> list[tuple[float, float]]:
    """max |K|, |V| per layer of transformers' own KV cache over the prompts: an independent
    reading of what the cache holds (K after k_norm and RoPE)."""
    out = [(0.0, 0.0)] * hf.config.num_hidden_layers
    with torch.no_grad():
        for x in ids:
            layers = hf(x, use_cache=True).past_key_values.layers
            out = [
                (max(a, float(c.keys.abs().max())), max(b, float(c.values.abs().max())))
                for (a, b), c in zip(out, layers)
            ]
    return out


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_target_kv_scales_bound_the_cached_k_and_v(family, fmt, tmp_path):
    """The target's scales are Model Optimizer's own export (deploy/modelopt_target.py); what the engines
    need from them is checked against transformers' own KV cache."""
    pytest.importorskip("modelopt")
    hf = tiny_hf(family)
    hf.save_pretrained(tmp_path / "src")
    ids = prompts()
    quantize_target(tmp_path / "src", tmp_path / "q", fmt, "fp8", [x[0].tolist() for x in ids], echo=lambda _: None)
    q, hq, _ = load_quantized_checkpoint(tmp_path / "q")
    assert hq["quantization"]["kv_cache_quant_algo"] == "FP8" and hq["producer"]["name"] == "modelopt"
    layers = hf.config.num_hidden_layers
    scales = {k: v for k, v in q.items() if k.endswith(("k_scale", "v_scale"))}
    want = {n for i in range(layers) for n in kv_scale_names(f"model.layers.{i}.self_attn")}
    assert set(scales) == want  # every attention layer, nothing else
    assert "model.layers.0.self_attn.k_proj.k_scale" in want  # modelopt's spelling, spelled out once
    for name, s in scales.items():
        assert s.dtype == torch.float32 and s.shape == () and math.isfinite(s.item()) and s.item() > 0
        i = name.split(".")[2]
        assert vllm_name(name) == f"model.layers.{i}.self_attn.attn.{name[-7:]}"  # vLLM's Attention params
    # the calibrated K / V divided by their scale stay within FP8 E4M3's 448, and the largest reaches it:
    # the scale is max |cached K| / 448 (post-RoPE; a pre-RoPE or pre-k_norm amax would miss one of the two).
    # modelopt runs the checkpoint's float32 here as transformers does; both reduce the same K with max, so
    # the two amax differ only by the order of the projection's sums (rel 1e-5 covers fp32 rounding of dot
    # products of length hidden_size = 64)
    for i, (k_amax, v_amax) in enumerate(cache_amax(hf, ids)):
        for amax, leaf in ((k_amax, "k_proj.k_scale"), (v_amax, "v_proj.v_scale")):
            ratio = amax / q[f"model.layers.{i}.self_attn.{leaf}"].item()
            assert ratio <= F.FP8_MAX * (1 + 1e-5) and ratio == pytest.approx(F.FP8_MAX, rel=1e-5)


def test_drafter_kv_scales_cover_context_and_block_kv():
    """The drafter's K/V go to the cache twice: context injection (target features) and the drafted
    block; a KVCache that records every write is the independent reading here."""

    class RecordingCache(KVCache):
        def write(self, layer, k, v, positions):  # k, v [R, H_kv, n, D]
            old = self.seen.get(layer, (0.0, 0.0))
            self.seen[layer] = (max(old[0], float(k.abs().max())), max(old[1], float(v.abs().max())))
            super().write(layer, k, v, positions)

    target = tiny_target("qwen3")
    drafter = tiny_drafter(target, block_size=4)
    c = drafter.config
    seen: dict = {}

    def run_one(ids):  # ids [1, n]: target prefill -> context injection -> one drafted block
        tc = target.new_cache(1, 64)
        taps = target(ids, tc, tap_layers=drafter.target_layer_ids).taps
        cache = RecordingCache(c.num_hidden_layers, 1, c.num_key_value_heads, c.head_dim, 72, torch.float32)
        cache.seen = seen
        drafter.inject_context(taps, torch.tensor([ids.shape[1]]), cache)
        block = torch.full((1, c.block_size), c.mask_token_id)
        block[0, 0] = ids[0, -1]
        drafter.draft_block(block, cache)

    act, kv = calibrate_amax(drafter, run_one, prompts(vocab=c.vocab_size), progress=False, kv=True)
    assert "kv" not in vars(drafter.layers[0].self_attn)  # the kv() wrapper is gone again
    q, hq = quantize_state_dict(drafter.state_dict(), "fp8", act_amax=act, kv_cache="fp8", kv_amax=kv)
    for i in range(c.num_hidden_layers):
        k_name, v_name = kv_scale_names(f"layers.{i}.self_attn")
        # vLLM's DFlash loader prefixes "model." before mapping (qwen3_dflash.py:866-867)
        assert vllm_name("model." + k_name) == f"model.layers.{i}.self_attn.attn.k_scale"
        for amax, name in zip(seen[i], (k_name, v_name)):
            assert q[name].shape == () and amax / q[name].item() == pytest.approx(F.FP8_MAX, rel=1e-5)
    assert hq["quantization"]["kv_cache_quant_algo"] == "FP8"


def test_kv_scales_survive_save_and_the_simulation_drops_them(tmp_path):
    """Model Optimizer's export of a target, read back as the torch engine reads it."""
    pytest.importorskip("modelopt")
    hf = tiny_hf("qwen3")
    hf.save_pretrained(tmp_path / "src")
    quantize_target(tmp_path / "src", tmp_path / "ckpt", "fp8", "fp8", [x[0].tolist() for x in prompts(2)], echo=print)
    q, _, _ = load_quantized_checkpoint(tmp_path / "ckpt")
    q2, hq2, cfg = load_quantized_checkpoint(tmp_path / "ckpt")
    name = "model.layers.1.self_attn.v_proj.v_scale"
    assert q2[name].dtype == torch.float32 and q2[name].shape == () and q2[name].item() == q[name].item()
    assert json.loads((tmp_path / "ckpt" / "hf_quant_config.json").read_text())["quantization"][
        "kv_cache_quant_algo"
    ] == ("FP8")
    assert cfg["quantization_config"]["kv_cache_scheme"] == {"dynamic": False, "num_bits": 8, "type": "float"}
    assert set(dequantize_state_dict(q2, hq2)) == set(hf.state_dict())  # what the torch engine loads


def test_fp8_kv_cache_without_scales_is_refused_on_save(tmp_path):
    hf = tiny_hf("qwen3")
    act, _ = calibrate_amax(hf, lambda x: hf(x), prompts(1), progress=False)  # activations only: no kv
    q, hq = quantize_state_dict(hf.state_dict(), "fp8", act_amax=act, kv_cache="fp8")
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.self_attn\.k_proj\.k_scale missing \(4 tensors\)"):
        save_quantized_checkpoint(tmp_path / "x", q, hq)
    assert not (tmp_path / "x").exists()
    with pytest.raises(ConfigError, match=r"kv_amax has no entry for model\.layers\.1\.self_attn"):
        quantize_state_dict(hf.state_dict(), "fp8", kv_cache="fp8", kv_amax={"model.layers.0.self_attn": (1.0, 1.0)})


def test_bf16_target_with_fp8_kv_cache_is_one_line():
    """A bf16 target has no checkpoint to carry the scales: modelopt would export KV-only (quant_algo
    null; unified_export_hf.py:1471-1474), which vLLM refuses (quantization/modelopt.py:362-363
    "Missing 'quant_algo'") as does SGLang (srt/layers/quantization/modelopt_quant.py:506-508)."""
    with pytest.raises(ConfigError) as e:
        check_kv_cache("bf16", "fp8")
    assert "\n" not in str(e.value) and str(e.value).startswith("kv_cache=fp8 with target_quant=bf16")
    for fmt, kv in (("fp8", "fp8"), ("nvfp4", "fp8"), ("bf16", "bf16"), ("bf16", None)):
        check_kv_cache(fmt, kv)


def test_build_with_fp8_kv_cache_writes_the_scales(tmp_path):
    from dflash_trt.deploy.build_config import BuildConfig
    from dflash_trt.deploy.run import run_build

    tiny_pair_dir(tmp_path, block_size=4)
    cfg = BuildConfig(
        target=str(tmp_path / "target"),
        drafter=str(tmp_path / "drafter"),
        target_quant="fp8",
        drafter_quant="fp8",
        kv_cache="fp8",
        dtype="float32",
        max_batch=2,
        max_seq_len=128,
        calib_prompts=2,
        eval_prompts=0,
        instance_count=1,
    )
    manifest = run_build(cfg, tmp_path / "out", echo=lambda _: None, progress=False)
    for which, prefix in (("target", "model."), ("drafter", "")):  # target: Model Optimizer's export
        qstate, hq, _ = load_quantized_checkpoint(tmp_path / "out" / "quantized" / which)
        assert hq["quantization"]["kv_cache_quant_algo"] == "FP8"
        for i in range(2):
            for name in kv_scale_names(f"{prefix}layers.{i}.self_attn"):
                assert qstate[name].shape == () and 0 < qstate[name].item() < math.inf
        assert manifest["stages"]["quantize"]["info"][which]["kv_scales"] == 4
