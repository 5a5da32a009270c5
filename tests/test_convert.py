"""HF target / DFlash drafter -> TensorRT-LLM checkpoints (dflash_trt.deploy.convert): names, shapes,
config fields, and tensor-parallel shards that merge back exactly, plain and quantised."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import tiny_hf
from safetensors.torch import load_file

from dflash_trt.deploy.convert import convert_drafter, convert_target, merge_ranks
from dflash_trt.deploy.hf_checkpoint import save_quantized_checkpoint
from dflash_trt.deploy.quantize import calibrate_act_amax, quantize_state_dict
from dflash_trt.errors import ConfigError

BF16 = torch.bfloat16


@pytest.fixture(scope="module", params=["qwen3", "qwen2", "llama"])
def model(request):
    return tiny_hf(request.param)


@pytest.fixture(scope="module")
def qwen3():
    return tiny_hf("qwen3")


def _amax(m):
    g = torch.Generator().manual_seed(2)
    return calibrate_act_amax(m, lambda ids: m(ids), [torch.randint(0, 256, (1, 8), generator=g)], progress=False)


def _same(a: dict, b: dict) -> bool:
    bits = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # noqa: E731
    return set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(bits(a[k]), bits(b[k])) for k in a)


def _cfg(folder):
    return json.loads((folder / "config.json").read_text())


def test_target_names_shapes_and_values(tmp_path, model):
    family = model.config.model_type
    sd = model.state_dict()
    out = convert_target((sd, model.config), tmp_path / "t", tp_size=1)
    w = load_file(str(out / "rank0.safetensors"))
    d, hd, nh, nkv = 64, 16, 4, 2
    for i in range(2):
        p, t = f"model.layers.{i}.", f"transformer.layers.{i}."
        qkv = torch.cat([sd[f"{p}self_attn.{x}_proj.weight"] for x in "qkv"])
        assert w[t + "attention.qkv.weight"].shape == ((nh + 2 * nkv) * hd, d)
        assert torch.equal(w[t + "attention.qkv.weight"], qkv.to(BF16))
        assert torch.equal(w[t + "attention.dense.weight"], sd[p + "self_attn.o_proj.weight"].to(BF16))
        assert torch.equal(w[t + "mlp.fc.weight"], sd[p + "mlp.gate_proj.weight"].to(BF16))  # activated branch
        assert torch.equal(w[t + "mlp.gate.weight"], sd[p + "mlp.up_proj.weight"].to(BF16))
        assert torch.equal(w[t + "mlp.proj.weight"], sd[p + "mlp.down_proj.weight"].to(BF16))
        assert torch.equal(w[t + "input_layernorm.weight"], sd[p + "input_layernorm.weight"].to(BF16))
        assert torch.equal(w[t + "post_layernorm.weight"], sd[p + "post_attention_layernorm.weight"].to(BF16))
        assert (t + "attention.q_layernorm.weight" in w) == (family == "qwen3")
        assert (t + "attention.qkv.bias" in w) == (family == "qwen2")
        if family == "qwen2":
            bias = torch.cat([sd[f"{p}self_attn.{x}_proj.bias"] for x in "qkv"])
            assert torch.equal(w[t + "attention.qkv.bias"], bias.to(BF16))
        if family == "qwen3":
            assert torch.equal(w[t + "attention.k_layernorm.weight"], sd[p + "self_attn.k_norm.weight"].to(BF16))
    assert torch.equal(w["transformer.vocab_embedding.weight"], sd["model.embed_tokens.weight"].to(BF16))
    assert torch.equal(w["transformer.ln_f.weight"], sd["model.norm.weight"].to(BF16))
    assert torch.equal(w["lm_head.weight"], sd["lm_head.weight"].to(BF16))
    assert len(w) == 3 + 2 * (7 + (2 if family == "qwen3" else 0) + (1 if family == "qwen2" else 0))
    assert all(v.dtype == BF16 for v in w.values())


def test_target_config_fields(tmp_path, model):
    family = model.config.model_type
    c = _cfg(
        convert_target(
            (model.state_dict(), model.config),
            tmp_path / "t",
            tp_size=2,
            quant="fp8",
            act_amax=_amax(model),
            kv_cache="fp8",
        )
    )
    archs = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}
    assert c["architecture"] == archs[family]
    assert (c["dtype"], c["num_hidden_layers"], c["num_attention_heads"]) == ("bfloat16", 2, 4)
    assert c["num_key_value_heads"] == 2
    assert (c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_size"]) == (64, 128, 256, 16)
    assert c["position_embedding_type"] == "rope_gpt_neox" and c["max_position_embeddings"] == 512
    assert c["norm_epsilon"] == model.config.rms_norm_eps and c["rotary_base"] > 0 and c["hidden_act"] == "silu"
    assert c["mapping"] == {"world_size": 2, "tp_size": 2, "pp_size": 1, "cp_size": 1}
    q = c["quantization"]
    assert (q["quant_algo"], q["kv_cache_quant_algo"], q["exclude_modules"]) == ("FP8", "FP8", ["lm_head"])
    assert c["qk_layernorm"] == (family == "qwen3") and c["attn_bias"] == (family == "qwen2")
    assert c.get("qwen_type") == (None if family == "llama" else family)


@pytest.mark.parametrize("quant", [None, "fp8", "fp8_per_channel", "nvfp4"])
def test_tp2_shards_merge_back_exactly(tmp_path, model, quant):
    sd, amax = model.state_dict(), _amax(model)
    one = convert_target((sd, model.config), tmp_path / "tp1", quant=quant, act_amax=amax)
    two = convert_target((sd, model.config), tmp_path / "tp2", tp_size=2, quant=quant, act_amax=amax)
    full = load_file(str(one / "rank0.safetensors"))
    assert _same(merge_ranks(two), full) and _same(merge_ranks(one), full)
    r0, r1 = (load_file(str(two / f"rank{r}.safetensors")) for r in range(2))
    t = "transformer.layers.0."
    packed = 2 if quant == "nvfp4" else 1
    assert r0[t + "attention.qkv.weight"].shape == ((2 + 1 + 1) * 16, 64 // packed)  # q heads/2, one kv head each
    assert r0[t + "attention.dense.weight"].shape == (64, 32 // packed)  # row-parallel: input dim split
    assert r0[t + "mlp.fc.weight"].shape == (64, 64 // packed) and r0[t + "mlp.proj.weight"].shape == (64, 64 // packed)
    assert r0["lm_head.weight"].shape == (128, 64)
    assert torch.equal(r0["transformer.ln_f.weight"], r1["transformer.ln_f.weight"])
    if quant is None:  # rank 1's fused qkv = its q heads, then its k head, then its v head
        sd1 = {x: sd[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv"}
        want = torch.cat([sd1["q"][32:], sd1["k"][16:], sd1["v"][16:]]).to(BF16)
        assert torch.equal(r1[t + "attention.qkv.weight"], want)
    if quant == "nvfp4":
        assert r0[t + "attention.dense.weights_scaling_factor"].shape == (64, 2)  # blocks of 16 follow the split
        assert r0[t + "attention.qkv.weights_scaling_factor_2"].shape == (1,)
        assert torch.equal(r0[t + "mlp.proj.activation_scaling_factor"], r1[t + "mlp.proj.activation_scaling_factor"])
    if quant == "fp8_per_channel":
        assert r0[t + "attention.qkv.per_channel_scale"].shape == (64,)
        assert r0[t + "mlp.proj.per_channel_scale"].shape == (64,)  # row-parallel: replicated
    if quant == "fp8":
        assert r0[t + "mlp.gate.weights_scaling_factor"].shape == (1,)
        assert r0[t + "mlp.gate.weight"].dtype == torch.float8_e4m3fn


def test_duplicated_kv_heads_and_padded_vocab(tmp_path):
    m = tiny_hf("qwen3", vocab_size=254)
    sd = m.state_dict()
    one = convert_target((sd, m.config), tmp_path / "tp1", quant="nvfp4", act_amax=_amax(m))
    four = convert_target((sd, m.config), tmp_path / "tp4", tp_size=4, quant="nvfp4", act_amax=_amax(m))
    r3 = load_file(str(four / "rank3.safetensors"))
    assert r3["lm_head.weight"].shape == (64, 64) and torch.all(r3["lm_head.weight"][-2:] == 0)  # 254 -> 256
    assert r3["transformer.layers.0.attention.qkv.weight"].shape == ((1 + 1 + 1) * 16, 32)  # 2 kv heads x2 copies
    assert _same(merge_ranks(four), load_file(str(one / "rank0.safetensors")))


def test_tied_embeddings_and_folder_sources(tmp_path, qwen3):
    sd = {k: v for k, v in qwen3.state_dict().items() if k != "lm_head.weight"}  # tied: no lm_head tensor
    w = load_file(str(convert_target((sd, qwen3.config), tmp_path / "tied") / "rank0.safetensors"))
    assert torch.equal(w["lm_head.weight"], w["transformer.vocab_embedding.weight"])
    qwen3.save_pretrained(tmp_path / "hf")
    from_dir = load_file(str(convert_target(tmp_path / "hf", tmp_path / "t1") / "rank0.safetensors"))
    from_mem = load_file(str(convert_target((qwen3.state_dict(), qwen3.config), tmp_path / "t2") / "rank0.safetensors"))
    assert _same(from_dir, from_mem)
    q, hq = quantize_state_dict(qwen3.state_dict(), "nvfp4", act_amax=_amax(qwen3))
    save_quantized_checkpoint(tmp_path / "q", q, hq, qwen3.config)  # hf_quant_config.json is picked up
    qd = convert_target(tmp_path / "q", tmp_path / "t3", tp_size=2)
    assert _cfg(qd)["quantization"]["quant_algo"] == "NVFP4"
    qm = convert_target((q, qwen3.config), tmp_path / "t4", tp_size=2, quant=hq)
    assert _same(merge_ranks(qd), merge_ranks(qm))
    convert_target((q, qwen3.config), tmp_path / "t4", tp_size=2, quant=hq)  # atomic overwrite
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]


def test_conversion_errors_name_the_field(tmp_path, qwen3):
    sd = qwen3.state_dict()
    with pytest.raises(ConfigError, match="tp_size=3"):
        convert_target((sd, qwen3.config), tmp_path / "x", tp_size=3)
    with pytest.raises(ConfigError, match="dtype=int8"):
        convert_target((sd, qwen3.config), tmp_path / "x", dtype="int8")
    with pytest.raises(ConfigError, match="activation_scaling_factor"):
        convert_target((sd, qwen3.config), tmp_path / "x", quant="fp8")  # no calibration
    bad = {**qwen3.config.to_dict(), "model_type": "gpt2"}
    with pytest.raises(ConfigError, match="model_type=gpt2"):
        convert_target((sd, bad), tmp_path / "x")
    assert not (tmp_path / "x").exists()


# ---- drafter -----------------------------------------------------------------------------------
def tiny_drafter_state(num_layers=2, taps=3, d=64, f=128, nh=4, nkv=2, hd=16):
    g = torch.Generator().manual_seed(5)
    r = lambda *s: torch.randn(*s, generator=g) * 0.05  # noqa: E731
    sd = {"fc.weight": r(d, taps * d), "hidden_norm.weight": 1 + r(d), "norm.weight": 1 + r(d)}
    for i in range(num_layers):
        p = f"layers.{i}."
        sd |= {
            p + "input_layernorm.weight": 1 + r(d),
            p + "post_attention_layernorm.weight": 1 + r(d),
            p + "self_attn.q_proj.weight": r(nh * hd, d),
            p + "self_attn.k_proj.weight": r(nkv * hd, d),
            p + "self_attn.v_proj.weight": r(nkv * hd, d),
            p + "self_attn.o_proj.weight": r(d, nh * hd),
            p + "self_attn.q_norm.weight": 1 + r(hd),
            p + "self_attn.k_norm.weight": 1 + r(hd),
            p + "mlp.gate_proj.weight": r(f, d),
            p + "mlp.up_proj.weight": r(f, d),
            p + "mlp.down_proj.weight": r(d, f),
        }
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": d,
        "intermediate_size": f,
        "num_hidden_layers": num_layers,
        "num_attention_heads": nh,
        "num_key_value_heads": nkv,
        "head_dim": hd,
        "vocab_size": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "max_position_embeddings": 512,
        "block_size": 8,
        "num_target_layers": 6,
        "dflash_config": {"mask_token_id": 255, "target_layer_ids": [1, 3, 4]},
    }
    return sd, cfg


@pytest.mark.parametrize("quant", [None, "nvfp4"])
def test_drafter_conversion(tmp_path, quant):
    sd, cfg = tiny_drafter_state()
    amax = {k[: -len(".weight")]: 2.0 for k in sd if k.endswith("proj.weight") or k == "fc.weight"}
    one = convert_drafter((sd, cfg), tmp_path / "d1", quant=quant, act_amax=amax)
    two = convert_drafter((sd, cfg), tmp_path / "d2", tp_size=2, quant=quant, act_amax=amax)
    c = _cfg(two)
    assert c["architecture"] == "DFlashDraftModel" and c["block_size"] == 8 and c["mask_token_id"] == 255
    assert c["target_layer_ids"] == [1, 3, 4] and c["num_target_layers"] == 6 and c["fc_in_features"] == 192
    assert c["qk_layernorm"] is True and c["rotary_base"] == 1e6 and c["mapping"]["tp_size"] == 2
    assert c["quantization"]["quant_algo"] == (None if quant is None else "NVFP4")
    w = load_file(str(one / "rank0.safetensors"))
    assert not any("vocab_embedding" in k or "lm_head" in k for k in w)  # shared with the target
    assert torch.equal(w["transformer.hidden_norm.weight"], sd["hidden_norm.weight"].to(BF16))
    assert torch.equal(w["transformer.ln_f.weight"], sd["norm.weight"].to(BF16))
    assert w["transformer.layers.1.attention.qkv.weight"].shape == (128, 64 if quant is None else 32)
    assert "transformer.layers.0.attention.k_layernorm.weight" in w
    if quant is None:
        assert torch.equal(w["transformer.fc.weight"], sd["fc.weight"].to(BF16))
        assert torch.equal(w["transformer.layers.0.mlp.fc.weight"], sd["layers.0.mlp.gate_proj.weight"].to(BF16))
    else:
        assert w["transformer.fc.weight"].shape == (64, 96)
        assert w["transformer.fc.weights_scaling_factor"].shape == (64, 12)
    r1 = load_file(str(two / "rank1.safetensors"))
    assert r1["transformer.fc.weight"].shape[0] == 32  # column-parallel fc
    assert _same(merge_ranks(two), w)


def test_drafter_config_must_be_dflash(tmp_path):
    sd, cfg = tiny_drafter_state()
    del cfg["dflash_config"]["target_layer_ids"]
    with pytest.raises(ConfigError, match="dflash_config.target_layer_ids"):
        convert_drafter((sd, cfg), tmp_path / "d")
