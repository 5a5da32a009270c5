"""FP8 / NVFP4 quantisation (dflash_trt.deploy.formats, .quantize, .hf_checkpoint), checked against
the format definitions; and, when nvidia-modelopt is importable, bit-for-bit against modelopt."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import tiny_hf

from dflash_trt.deploy import formats as F
from dflash_trt.deploy.hf_checkpoint import load_quantized_checkpoint, save_quantized_checkpoint
from dflash_trt.deploy.quantize import (
    calibrate_act_amax,
    check_quant_target,
    dequantize_state_dict,
    kv_scales,
    quantizable_modules,
    quantize_state_dict,
)
from dflash_trt.errors import ConfigError


@pytest.fixture(scope="module")
def tiny_qwen3():
    return tiny_hf("qwen3")


@pytest.fixture(scope="module")
def amax(tiny_qwen3):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (1, 12), generator=g) for _ in range(3)]
    return calibrate_act_amax(tiny_qwen3, lambda ids: tiny_qwen3(ids), prompts, progress=False)


def _weights(seed=0, shape=(48, 64)):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.logspace(-3, 1, shape[0])[:, None]  # rows of very different size
    w[3] = 0.0  # an all-zero row / blocks
    w[5, 7] = 40.0  # an outlier
    return w


def _bits(t):
    return t.view(torch.uint8) if t.dtype == F.FP8_DTYPE else t


# ---- FP8 -------------------------------------------------------------------------------------
@pytest.mark.parametrize("per_channel", [False, True])
def test_fp8_error_within_half_step(per_channel):
    w = _weights()
    s = F.fp8_scale(w, per_channel)
    assert s.dtype == torch.float32 and s.shape == ((w.shape[0],) if per_channel else ())
    q = F.fp8_quantize(w, s)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    sb = s[:, None] if per_channel else s
    err = (F.fp8_dequantize(q, s) - w).abs()
    bound = F.fp8_half_step(w / sb) * sb  # half the gap between neighbouring E4M3 values, in w's units
    assert torch.all(err <= bound * (1 + 1e-6))
    assert torch.all(F.fp8_dequantize(q, s)[3] == 0)


def test_fp8_values_are_exact():
    codes = torch.arange(256, dtype=torch.uint8).view(F.FP8_DTYPE).float()
    vals = codes[torch.isfinite(codes)]  # every finite E4M3 value, +-448 included
    w = (vals * 0.5).reshape(1, -1)  # scale 448*0.5/448 = 0.5 exactly
    s = F.fp8_scale(w)
    assert s.item() == 0.5
    assert torch.equal(F.fp8_dequantize(F.fp8_quantize(w, s), s), w)


def test_fake_quant_fp8_matches_round_trip_and_saturates():
    x = torch.randn(4, 8, 16, dtype=torch.bfloat16) * 3
    s = torch.tensor(0.01)
    fq = F.fake_quant_fp8(x, s)
    assert fq.dtype == x.dtype
    assert torch.equal(fq, F.fake_quant_fp8(fq, s))  # idempotent
    assert torch.equal(
        fq.float(),
        F.fp8_dequantize(F.fp8_quantize(x.float().reshape(-1, 16), s), s).reshape(x.shape).to(x.dtype).float(),
    )
    assert F.fake_quant_fp8(torch.tensor([1e6]), 1.0).item() == 448.0  # saturates, no NaN


# ---- E2M1 / NVFP4 ----------------------------------------------------------------------------
def test_e2m1_codes_values_and_packing():
    codes = torch.tensor([c for c in range(16) if c != 8], dtype=torch.uint8)  # 8 is -0
    vals = F.e2m1_decode(codes)
    assert vals[:8].tolist() == list(F.E2M1_VALUES) and vals[8:].tolist() == [-v for v in F.E2M1_VALUES[1:]]
    assert torch.equal(F.e2m1_encode(vals), codes)  # every format value is exact
    # ties go to the even code; beyond 6 saturates
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 9.0, -0.75])
    assert F.e2m1_decode(F.e2m1_encode(ties)).tolist() == [0, 1, 1, 2, 2, 4, 4, 6, -1]
    # element 2j -> low nibble, 2j+1 -> high nibble
    assert F.pack_e2m1(torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)).tolist() == [[0x21, 0x0F]]
    rand = torch.randint(0, 16, (5, 32), dtype=torch.uint8)
    packed = F.pack_e2m1(rand)
    assert packed.shape == (5, 16) and torch.equal(F.unpack_e2m1(packed), rand)


def test_nvfp4_layout_and_error_bound():
    w = _weights()
    packed, bs, gs = F.nvfp4_quantize(w)
    assert packed.dtype == torch.uint8 and packed.shape == (48, 32)
    assert bs.dtype == torch.float8_e4m3fn and bs.shape == (48, 4)
    assert gs.dtype == torch.float32 and gs.shape == () and gs.item() == pytest.approx(40.0 / (6 * 448))
    S = (bs.float() * gs)[:, :, None]  # effective scale of each 16-block
    y = (w.unflatten(-1, (-1, 16)) / S).abs()
    err = (F.nvfp4_dequantize(packed, bs, gs) - w).abs().unflatten(-1, (-1, 16))
    # half the E2M1 spacing at |y| (values past 6, possible when the FP8 block scale rounds down, saturate)
    bound = torch.where(y <= 6, F.e2m1_half_step(y), y - 6) * S
    assert torch.all(err <= bound * (1 + 1e-5) + 1e-6 * w.unflatten(-1, (-1, 16)).abs())  # + float32 rounding
    assert torch.all(F.nvfp4_dequantize(packed, bs, gs)[3] == 0)


def test_nvfp4_format_values_are_exact():
    gs = 2.0**-10  # tensor amax 6*448*gs -> weight_scale_2 exactly gs; block scales 448 and 4 exact
    vals = torch.tensor(F.E2M1_VALUES)
    row = torch.cat([vals, -vals.flip(0)])  # 16 values incl. +-6: one block
    w = torch.stack([row * 448 * gs, row * 4 * gs])
    packed, bs, g = F.nvfp4_quantize(w)
    assert g.item() == gs and bs.float().flatten().tolist() == [448.0, 4.0]
    assert torch.equal(F.nvfp4_dequantize(packed, bs, g), w)


def test_nvfp4_needs_blocks_of_16():
    with pytest.raises(ValueError, match="multiple of 16"):
        F.nvfp4_quantize(torch.randn(4, 24))


# ---- state dicts -----------------------------------------------------------------------------
def test_only_decoder_linears_and_drafter_fc_are_quantizable(tiny_qwen3):
    mods = quantizable_modules(tiny_qwen3.state_dict())
    assert len(mods) == 2 * 7 and "model.layers.1.mlp.down_proj" in mods
    assert not any(("norm" in m) or ("embed" in m) or ("lm_head" in m) for m in mods)
    drafter = [
        "fc.weight",
        "hidden_norm.weight",
        "layers.0.self_attn.q_proj.weight",
        "layers.0.self_attn.q_norm.weight",
        "norm.weight",
    ]
    assert quantizable_modules(drafter) == ["fc", "layers.0.self_attn.q_proj"]


@pytest.mark.parametrize("fmt", ["fp8", "fp8_per_channel", "nvfp4"])
def test_quantized_state_dict_layout(tiny_qwen3, amax, fmt):
    sd = tiny_qwen3.state_dict()
    q, hq = quantize_state_dict(sd, fmt, act_amax=amax, kv_cache="fp8")
    algo = {"fp8": "FP8", "fp8_per_channel": "FP8_PER_CHANNEL_PER_TOKEN", "nvfp4": "NVFP4"}[fmt]
    want = {"quant_algo": algo, "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]}
    if fmt == "nvfp4":
        want["group_size"] = 16
    assert hq["quantization"] == want and hq["producer"]["name"]
    m = "model.layers.0.self_attn.k_proj"  # [32, 64]
    if fmt == "nvfp4":
        assert (q[m + ".weight"].dtype, q[m + ".weight"].shape) == (torch.uint8, (32, 32))
        assert (q[m + ".weight_scale"].dtype, q[m + ".weight_scale"].shape) == (torch.float8_e4m3fn, (32, 4))
        assert q[m + ".weight_scale_2"].shape == () and q[m + ".input_scale"].shape == ()
        assert q[m + ".input_scale"].item() == pytest.approx(amax[m] / (6 * 448))
    else:
        assert (q[m + ".weight"].dtype, q[m + ".weight"].shape) == (torch.float8_e4m3fn, (32, 64))
        assert q[m + ".weight_scale"].dtype == torch.float32
        assert q[m + ".weight_scale"].shape == ((32,) if fmt == "fp8_per_channel" else ())
        assert (m + ".input_scale" in q) == (fmt == "fp8")
        if fmt == "fp8":
            assert q[m + ".input_scale"].item() == pytest.approx(amax[m] / 448)
    # fused groups (q|k|v, gate|up) share the per-tensor weight scale and the input scale
    shared = {"fp8": ["weight_scale", "input_scale"], "nvfp4": ["weight_scale_2", "input_scale"]}.get(fmt, [])
    for leaf in shared:
        for group in (["q_proj", "k_proj", "v_proj"], ["gate_proj", "up_proj"]):
            part = "self_attn" if group[0] == "q_proj" else "mlp"
            vals = {q[f"model.layers.1.{part}.{g}.{leaf}"].item() for g in group}
            assert len(vals) == 1
    for k in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.self_attn.q_norm.weight",
    ):
        assert torch.equal(q[k], sd[k])
    deq = dequantize_state_dict(q, hq)
    assert set(deq) == set(sd)
    w = sd["model.layers.0.mlp.down_proj.weight"]
    assert (deq["model.layers.0.mlp.down_proj.weight"] - w).abs().max() <= w.abs().max() / (6 if fmt == "nvfp4" else 16)


def test_missing_calibration_entry_names_the_layer(tiny_qwen3, amax):
    partial = {k: v for k, v in amax.items() if "layers.1.mlp" not in k}
    with pytest.raises(ConfigError, match=r"model\.layers\.1\.mlp\.\w+_proj"):
        quantize_state_dict(tiny_qwen3.state_dict(), "fp8", act_amax=partial)


def test_calibration_records_inputs(tiny_qwen3, amax):
    assert len(amax) == 14 and all(v > 0 for v in amax.values())
    qkv = {amax[f"model.layers.0.self_attn.{p}_proj"] for p in "qkv"}
    assert len(qkv) == 1  # q, k and v see the same input


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_quantized_checkpoint_saves_and_reloads(tmp_path, tiny_qwen3, amax, fmt):
    sd = tiny_qwen3.state_dict()  # tied-free here, but lm_head/embeddings must survive as-is
    q, hq = quantize_state_dict(sd, fmt, act_amax=amax)
    out = tmp_path / "ckpt"
    save_quantized_checkpoint(out, q, hq, tiny_qwen3.config)
    save_quantized_checkpoint(out, q, hq, tiny_qwen3.config)  # overwrite in place
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary folders left behind
    q2, hq2, cfg = load_quantized_checkpoint(out)
    assert hq2 == hq and set(q2) == set(q)
    assert all(q2[k].dtype == q[k].dtype and torch.equal(_bits(q2[k]), _bits(q[k])) for k in q)
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == hq["quantization"]["quant_algo"]
    assert qc["ignore"] == ["lm_head"] and qc["config_groups"]["group_0"]["targets"] == ["Linear"]
    bits = qc["config_groups"]["group_0"]["weights"]["num_bits"]
    assert bits == (4 if fmt == "nvfp4" else 8) and cfg["model_type"] == "qwen3"
    assert json.loads((out / "hf_quant_config.json").read_text()) == hq


def test_save_refuses_missing_activation_scales(tmp_path, tiny_qwen3):
    q, hq = quantize_state_dict(tiny_qwen3.state_dict(), "fp8")
    with pytest.raises(ConfigError, match="input_scale missing"):
        save_quantized_checkpoint(tmp_path / "x", q, hq)
    assert not (tmp_path / "x").exists()
    save_quantized_checkpoint(tmp_path / "x", q, hq, require_input_scales=False)
    assert (tmp_path / "x" / "model.safetensors").is_file()


# ---- hardware generation ---------------------------------------------------------------------
def test_nvfp4_on_hopper_is_a_one_line_config_error():
    with pytest.raises(ConfigError) as e:
        check_quant_target("nvfp4", "sm_90")
    msg = str(e.value)
    assert "\n" not in msg and "quantization.weights=nvfp4" in msg and "gpu_arch=sm_90" in msg and "fp8" in msg
    for sm in ("sm_90", "sm_100", "sm_120"):
        check_quant_target("fp8", sm, kv_cache="fp8")
    check_quant_target("nvfp4", "sm_100")
    check_quant_target("nvfp4", "sm_120")
    check_quant_target(None, "sm_90")
    with pytest.raises(ConfigError, match="gpu_arch=sm_80"):
        check_quant_target("fp8", "sm_80")
    with pytest.raises(ConfigError, match="quantization.weights=int4"):
        check_quant_target("int4", "sm_100")


# ---- cross-check with NVIDIA Model Optimizer (optional) -----------------------------------------
def test_matches_modelopt_bit_for_bit():
    pytest.importorskip("modelopt")
    try:
        from modelopt.torch.quantization.qtensor import FP8QTensor, NVFP4QTensor
    except Exception as e:  # installed without its dependencies
        pytest.skip(f"modelopt not importable: {e}")
    w = _weights(seed=3, shape=(32, 128))
    qt, bs, gs = NVFP4QTensor.quantize(w.clone(), 16)
    packed, bs2, gs2 = F.nvfp4_quantize(w)
    assert torch.equal(qt._quantized_data, packed) and torch.equal(bs.view(torch.uint8), bs2.view(torch.uint8))
    assert torch.equal(gs, gs2)
    ref = qt.dequantize(dtype=torch.float32, scale=bs, double_scale=gs, block_sizes={-1: 16})
    assert torch.equal(ref, F.nvfp4_dequantize(packed, bs2, gs2))
    # modelopt 0.47 turns an all-zero row into NaN per channel (newer modelopt keeps 0, as we do)
    nz = w.abs().amax(1) > 0
    for axis, per_channel in ((None, False), (0, True)):
        q8, s8 = FP8QTensor.quantize(w, axis=axis)
        ours = F.fp8_quantize(w, F.fp8_scale(w, per_channel))
        assert torch.equal(q8._quantized_data.view(torch.uint8)[nz], ours.view(torch.uint8)[nz])
        assert torch.equal(
            s8.flatten()[nz] if per_channel else s8, F.fp8_scale(w, per_channel)[nz] if per_channel else F.fp8_scale(w)
        )


def test_kv_scales_match_modelopt_export():
    """modelopt's HF export turns each attention layer's k/v_bmm_quantizer amax into
    `<attn>.k_proj.k_scale` / `.v_proj.v_scale` = amax / 448 (quant_utils.py postprocess_state_dict,
    unified_export_hf.py kv_cache_max_bound = 448); ours must be the same tensors, bit for bit."""
    pytest.importorskip("modelopt")
    try:
        from modelopt.torch.export.quant_utils import postprocess_state_dict
    except Exception as e:  # installed without its dependencies
        pytest.skip(f"modelopt not importable: {e}")
    amax = {"model.layers.0.self_attn": (3.0117, 0.5360), "model.layers.1.self_attn": (2.8061, 1e-3)}
    theirs = postprocess_state_dict(
        {f"{a}.{q}_bmm_quantizer._amax": torch.tensor(v[i]) for a, v in amax.items() for i, q in enumerate("kv")},
        448,
        "FP8",
    )
    ours = kv_scales(amax, amax)
    assert set(theirs) == set(ours)
    assert all(torch.equal(theirs[k].float().reshape(()), ours[k]) for k in ours)
