"""Interop (issue #39 item 5): every folder `dflash-trt build` emits for vLLM 0.33 / SGLang 0.5.23 loads
correctly in the engines' own config and weight-loading code, or is refused by our build with one line.

Opt-in (marker `interop`): it needs the separate interop venv (vllm + sglang installed --no-deps, ~2.3 GB;
setup in scripts/interop_check.py's docstring) and skips with the reason where that is absent. The cheap
part, that the checker's decoding of the engines' parameters catches the known failure modes, runs
everywhere: scripts/interop_engines.py imports its stand-ins at module top, so those tests load its
functions without importing it.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import interop_check  # noqa: E402  (a script, not a package)

pytestmark = pytest.mark.interop


def engine_functions() -> dict:
    """dequant / destinations / close / compare from interop_engines.py, without its engine imports."""
    src = (ROOT / "scripts" / "interop_engines.py").read_text()
    tree = ast.parse(src)
    keep = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.Assign)) and not _imports_engine(n)]
    ns = {"torch": torch, "__name__": "interop_engines_part"}
    exec(compile(ast.Module(body=keep, type_ignores=[]), "interop_engines.py", "exec"), ns)  # noqa: S102
    return ns


def _imports_engine(node) -> bool:
    return isinstance(node, ast.FunctionDef) and node.name.startswith("run_")


def fp8(w: torch.Tensor):
    s = w.abs().max() / 448
    return (w / s).to(torch.float8_e4m3fn), s.reshape(())


def test_checker_catches_raw_fp8_codes_and_dropped_scales():
    """SGLang's DFlashDraftModel.supports_quantization=False case: `fc` a plain Linear holding the fp8
    codes as values, fc.weight_scale dropped: both reported, with the ~1/scale magnitude."""
    f = engine_functions()
    torch.manual_seed(0)
    w = torch.randn(8, 16) * 0.02
    q, s = fp8(w)
    ours = {"fc.weight": q.float() * s, "fc.weight_scale": s}
    engine = {"state": {"fc.weight": q.to(torch.bfloat16)}, "widths": {}}
    problems = f["compare"](engine, ours, "drafter")
    assert any(p.startswith("drafter fc.weight -> fc.weight: differs") for p in problems), problems
    assert any("fc.weight_scale: not in the engine's model" in p for p in problems), problems
    good = {"state": {"fc.weight": q, "fc.weight_scale": s.reshape(1)}, "widths": {"fc": [8]}}
    assert f["compare"](good, ours, "drafter") == []


def test_checker_catches_an_unloaded_scale_and_checks_fused_shards():
    """vLLM's DSpark markov_w2 case (scale left at its -3.4e38 init) and q/k/v fused into qkv_proj
    with one scale per shard (each compared with our own dequantized q, k, v)."""
    f = engine_functions()
    torch.manual_seed(1)
    parts = [torch.randn(n, 16) for n in (8, 4, 4)]
    qs = [fp8(p) for p in parts]
    ours = {f"l.self_attn.{p}_proj.weight": q.float() * s for p, (q, s) in zip("qkv", qs)}
    state = {
        "l.self_attn.qkv_proj.weight": torch.cat([q for q, _ in qs]),
        "l.self_attn.qkv_proj.weight_scale": torch.stack([s for _, s in qs]),
    }
    snap = {"state": state, "widths": {"l.self_attn.qkv_proj": [8, 4, 4]}}
    assert f["compare"](snap, ours, "target") == []
    state["l.self_attn.qkv_proj.weight_scale"] = torch.full((3,), torch.finfo(torch.float32).min)
    problems = f["compare"](snap, ours, "target")
    assert any("scale never loaded" in p for p in problems) and len(problems) == 4, problems


def test_nvfp4_decoding_matches_ours():
    """The worker's own NVFP4 decode (independent of dflash_trt) agrees with dflash_trt's."""
    from dflash_trt.deploy import formats as F

    f = engine_functions()
    torch.manual_seed(2)
    w = torch.randn(8, 32)
    gs = F.nvfp4_global_scale(w)
    packed, bs, gs = F.nvfp4_quantize(w, gs)
    state = {"m.weight": packed, "m.weight_scale": bs, "m.weight_scale_2": gs.reshape(1)}
    # the same three float32 factors multiplied in another order: at most 2 ulp apart
    torch.testing.assert_close(f["dequant"](state, "m", [8]), F.nvfp4_dequantize(packed, bs, gs), rtol=2**-22, atol=0)


def test_every_emitted_folder_loads_in_vllm_and_sglang(tmp_path):
    why = interop_check.engines_available()
    if why:
        pytest.skip(why)
    rows = interop_check.check(tmp_path)
    assert len(rows) == len(interop_check.FAMILIES) * len(interop_check.QUANTS) * len(interop_check.ENGINES)
    bad = [f"{r.family}/{r.quant}/{r.engine}: {r.cell}" for r in rows if r.cell != "ok" and "refused" not in r.cell]
    assert not bad, "\n" + "\n".join(bad)
