"""Family capabilities (families/capabilities.py, CAPS in each family module): what each engine is given,
and an undeclared family refused everywhere.

The matrix below is the issue #39 table "engine x family x drafter_quant -> what is emitted", each row
taken from the engines' own code (vllm 0.33.0 / sglang 0.5.23 wheels, paths relative to the package):
  * SGLang: DFlashDraftModel.supports_quantization = False (srt/models/dflash.py:685), so `fc` is a plain
    nn.Linear (:772) and the layers get no quant prefix (:738); DFlash2DraftModel (:1264) and
    DSparkDraftModel (srt/models/dspark.py:967) subclass it: a quantized drafter would load fp8 codes as
    values, so every family gets the bf16 copy;
  * vLLM: DFlashQwen3Model's layers and fc take the draft quant_config (model_executor/models/
    qwen3_dflash.py:466-486), DFlash 2's kernel_projection too (qwen3_dflash2.py:194-201), DSpark's
    markov_w2 is a ParallelLMHead with the quant_config (qwen3_dspark.py:72-78): quantized drafters load
    when exclude_modules names every linear left in bf16; no Domino (registry.py:654-680);
  * TensorRT-LLM: the bf16 drafter (its DFlash/DSpark drafter projects context K/V with raw qkv_proj
    weights), DFlash and DSpark only.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
import yaml
from click.testing import CliRunner
from conftest import tiny_model_dir

from dflash_trt.cli import main
from dflash_trt.config import DrafterConfig
from dflash_trt.decoding.engine import SpecEngine
from dflash_trt.deploy.emit import drafter_note
from dflash_trt.errors import ConfigError, DFlashError
from dflash_trt.families import FAMILIES, dflash, dflash2, domino, dspark
from dflash_trt.families.capabilities import ENGINES, caps_of, drafter_copy, refusal
from dflash_trt.modeling.drafter import DFlashDrafter
from dflash_trt.modeling.fast_path import drafter_unsupported_reason
from dflash_trt.modeling.target import TargetModel

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py

SPARK = {**dspark.DEFAULTS, "markov_rank": 8, "confidence_head_alpha": 1.0}
FIELDS = {
    "dflash": {},
    "dflash2": {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 16, "selector_top_k": 8},
    "dspark": SPARK,
    "domino": {**domino.DEFAULTS, "emb_dim": 32, "gru_hidden_dim": 16, "pure_draft_prefix_len": 1},
}
Q, C, R = "quantized", "bf16", "refused"  # a quantized build: the quantized drafter, the bf16 copy, refusal
EXPECTED = {  # (family, engine) -> what a quantized drafter build gives that engine
    ("dflash", "vllm"): Q,
    ("dflash", "sglang"): C,
    ("dflash", "trtllm-pytorch"): C,
    ("dflash", "torch"): Q,
    ("dflash2", "vllm"): Q,
    ("dflash2", "sglang"): C,
    ("dflash2", "trtllm-pytorch"): R,
    ("dflash2", "torch"): Q,
    ("dspark", "vllm"): Q,
    ("dspark", "sglang"): C,
    ("dspark", "trtllm-pytorch"): C,
    ("dspark", "torch"): Q,
    ("domino", "vllm"): R,
    ("domino", "sglang"): C,
    ("domino", "trtllm-pytorch"): R,
    ("domino", "torch"): Q,
}


def config_of(target_config, family: str) -> DrafterConfig:
    cfg = DrafterConfig.for_target(target_config, num_layers=1, block_size=4)
    arch = FAMILIES_BY_NAME[family].ARCHITECTURE
    return dataclasses.replace(cfg, architectures=[arch], family_fields=dict(FIELDS[family]))


FAMILIES_BY_NAME = {m.NAME: m for m in (dflash, dflash2, dspark, domino)}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("caps")
    tiny_model_dir(root / "target")
    return root / "target"


@pytest.mark.parametrize("quant", ["bf16", "fp8", "nvfp4"])
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("family", ["dflash", "dflash2", "dspark", "domino"])
def test_what_each_engine_is_given(target_dir, family, engine, quant):
    dc = config_of(TargetModel.from_pretrained(target_dir, dtype=torch.float32).config, family)
    want = EXPECTED[(family, engine)]
    why = refusal(dc.family, engine, dc.family_fields, quant)
    if want == R:
        assert why and "\n" not in why
        with pytest.raises(ConfigError):
            drafter_copy(dc.family, engine, quant)
        return
    assert why is None
    got = drafter_copy(dc.family, engine, quant)
    assert got == ("bf16-only" if quant == "bf16" else want)
    if engine in ("vllm", "sglang"):  # the one line the build table prints for it
        _, line = drafter_note(dc, engine, quant)
        if got == C:
            assert line.startswith(f"drafter bf16 copy, not {quant}: {engine}'s {dc.family.LABEL} loader")
        else:
            assert "bf16 copy" not in line


def test_every_registered_family_declares_capabilities(target_dir):
    tc = TargetModel.from_pretrained(target_dir).config
    for fam in FAMILIES.values():
        caps = caps_of(fam)
        assert set(caps.engines) | set(caps.refused) == set(ENGINES), fam.NAME  # every engine: run or refuse
        assert "lm_head" in caps.quant_exclude
        # the decoding switches promise only what the family's propose gives
        offered = fam.lengths(config_of(tc, fam.NAME))
        assert caps.draft_cutoff == ("probability" in offered), fam.NAME
        assert (not caps.hybrid or caps.draft_cutoff) and (not caps.cuda_graph or caps.kernels), fam.NAME
        if not caps.draft_vocab:
            with pytest.raises(ConfigError, match=f"draft vocabularies are not supported for {fam.LABEL}"):
                dataclasses.replace(config_of(tc, fam.NAME), draft_vocab_size=40)
        else:
            assert dataclasses.replace(config_of(tc, fam.NAME), draft_vocab_size=40).draft_vocab_size == 40


def test_draft_vocabulary_dropped_is_said(target_dir):
    dc = dataclasses.replace(config_of(TargetModel.from_pretrained(target_dir).config, "dflash"), draft_vocab_size=40)
    assert "dropped" not in drafter_note(dc, "vllm", "bf16")[1]  # vLLM: lm_head rows + d2t
    assert (
        "draft vocabulary (40 tokens) dropped: sglang drafts over the full vocabulary"
        in drafter_note(dc, "sglang", "bf16")[1]
    )


# ---- an undeclared family ---------------------------------------------------------------------------------
@pytest.fixture
def dummy_family(monkeypatch):
    """A family registered with everything the model needs but no deploy capabilities (no CAPS)."""
    mod = types.ModuleType("dummy_family")
    for k, v in vars(dflash).items():
        if not k.startswith("__") and k != "CAPS":
            setattr(mod, k, v)
    mod.NAME, mod.ARCHITECTURE, mod.LABEL = "dummy", "DummyDraftModel", "Dummy"
    monkeypatch.setitem(FAMILIES, mod.ARCHITECTURE, mod)
    return mod


@pytest.fixture
def switched_off(monkeypatch):
    """Plain DFlash under another name whose CAPS turns every decoding switch off: decoding must follow the
    declaration, not the (DFlash) propose step behind it."""
    mod = types.ModuleType("switched_off")
    for k, v in vars(dflash).items():
        if not k.startswith("__"):
            setattr(mod, k, v)
    mod.NAME, mod.ARCHITECTURE, mod.LABEL = "off", "OffDraftModel", "Off"
    off = dict(kernels=False, cuda_graph=False, draft_vocab=False, draft_cutoff=False, hybrid=False)
    mod.CAPS = dataclasses.replace(dflash.CAPS, **off)
    monkeypatch.setitem(FAMILIES, mod.ARCHITECTURE, mod)
    return mod


def test_decoding_reads_the_family_switches(target_dir, switched_off, dummy_family):
    target = TargetModel.from_pretrained(target_dir, dtype=torch.float32)
    plain = DFlashDrafter(config_of(target.config, "dflash"))
    assert SpecEngine(target, plain, proposer="auto").proposer.name == "hybrid"
    cfg = dataclasses.replace(config_of(target.config, "dflash"), architectures=["OffDraftModel"])
    off = DFlashDrafter(DrafterConfig.from_json_dict(cfg.to_json_dict()))
    assert off.family is switched_off  # the Triton kernels refuse it (kernels=auto: the PyTorch path)
    assert "the drafter kernels implement plain DFlash, not Off" in drafter_unsupported_reason(off.config)
    assert SpecEngine(target, off, proposer="auto").proposer.name == "dflash"  # auto: no hybrid for it
    for opts, why in (
        ({"proposer": "hybrid"}, "proposer=hybrid: Off drafters give no per-draft probability"),
        ({"proposer": "tree"}, "proposer=tree: Off drafters give no per-draft probability"),
        ({"draft_cutoff": 0.3}, "draft_cutoff=0.3: not supported for Off drafters"),
        ({"cuda_graph": "on"}, "the Off drafter step has no CUDA-graph replay"),
    ):
        with pytest.raises(DFlashError, match=why):
            SpecEngine(target, off, **opts)
    with pytest.raises(ConfigError, match="draft vocabularies are not supported for Off"):
        dataclasses.replace(cfg, draft_vocab_size=40)
    # a family that declares nothing is refused at the engine's start too, in one line
    cfg = dataclasses.replace(config_of(target.config, "dflash"), architectures=["DummyDraftModel"])
    with pytest.raises(ConfigError, match="'Dummy' declares no deploy capabilities"):
        SpecEngine(target, DFlashDrafter(DrafterConfig.from_json_dict(cfg.to_json_dict())))


def build(tmp_path, target, drafter, stage: str, **over) -> object:
    fields = {"target": str(target), "drafter": str(drafter), "max_batch": 2, "max_seq_len": 128, "eval_prompts": 0}
    (tmp_path / "b.yaml").write_text(yaml.safe_dump({**fields, **over}))
    args = [
        "build",
        *([] if stage == "all" else [stage]),
        "--config",
        str(tmp_path / "b.yaml"),
        "--out",
        str(tmp_path / "out"),
    ]
    return CliRunner().invoke(main, args)


@pytest.mark.parametrize(("stage", "over"), [("all", {}), ("emit", {"emit": ["vllm"]}), ("emit", {"emit": ["sglang"]})])
def test_a_family_without_capabilities_is_refused_by_build_and_emit(target_dir, tmp_path, dummy_family, stage, over):
    target = TargetModel.from_pretrained(target_dir, dtype=torch.float32)
    cfg = dataclasses.replace(config_of(target.config, "dflash"), architectures=["DummyDraftModel"])
    assert DrafterConfig.from_json_dict(cfg.to_json_dict()).family is dummy_family  # the model side knows it
    DFlashDrafter(cfg).save_pretrained(tmp_path / "drafter")
    r = build(tmp_path, target_dir, tmp_path / "drafter", stage, **over)
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert "'Dummy' declares no deploy capabilities" in lines[0]
    assert not (tmp_path / "out").exists()  # nothing built


# ---- exclude_modules of a quantized drafter (issue #39 item 4) ----------------------------------------------
@pytest.mark.parametrize("family", ["dflash2", "dspark", "domino"])
def test_every_unquantized_matrix_of_a_quantized_drafter_is_excluded(target_dir, tmp_path, family):
    """vLLM builds every linear it has a quant_config for as quantized unless exclude_modules names it
    (layers/quantization/modelopt.py:191-221 is_layer_excluded): DSpark's markov_w2 (qwen3_dspark.py:72-78)
    and DFlash 2's kernel_projection (qwen3_dflash2.py:194-201) would otherwise load bf16 weights into fp8."""
    target = TargetModel.from_pretrained(target_dir, dtype=torch.float32)
    DFlashDrafter(config_of(target.config, family)).save_pretrained(tmp_path / "drafter")
    over = {"drafter_quant": "fp8", "calib_prompts": 1, "calib_seq_len": 16}
    r = build(tmp_path, target_dir, tmp_path / "drafter", "quantize", **over)
    assert r.exit_code == 0, r.output
    from dflash_trt.deploy.hf_checkpoint import load_quantized_checkpoint

    qstate, hq, _ = load_quantized_checkpoint(tmp_path / "out" / "quantized" / "drafter")
    excluded = set(hq["quantization"]["exclude_modules"])
    quantized = {k.rsplit(".", 1)[0] for k in qstate if k.endswith(".weight_scale")}
    assert quantized and not quantized & excluded
    for k, v in qstate.items():
        module = k.rsplit(".", 1)[0]
        if v.dim() >= 2 and module not in quantized:
            assert module in excluded, k
    heads = {"dspark": "markov_head.markov_w2", "dflash2": "layers.0.attention_conv", "domino": "prefix_gru"}
    assert heads[family] in excluded and "kept bf16: " in r.output
