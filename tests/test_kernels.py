"""Triton kernels == their PyTorch references (CPU interpreter), and their AOT compile for GPU archs.

Runs with TRITON_INTERPRET=1 so every @triton.jit kernel executes on CPU tensors; the grid is
small (few rows, short contexts, small d and V) because the interpreter is slow.
Tolerances (max abs error vs the fp32 reference, after casting both to the storage dtype):
  fp32 storage 2e-5 | bf16 3e-2 + 2e-2 rel | fp16 4e-3 + 2e-3 rel | fp8 cache: 1 e4m3 step.
The interpreter rounds fp32->bf16 by truncation, hence bf16 allows ~1 ulp beyond rounding.

DFLASH_TEST_KERNELS_ON_GPU=1 (scripts/gpu_check.sh) runs the same tests compiled for the local
CUDA GPU instead: no interpreter, every launcher call gets CUDA copies of its tensor arguments
and writes in-place results back, so the tests themselves stay CPU code.
"""

import importlib.util
import os
import subprocess
import sys

_PREV_INTERPRET = os.environ.get("TRITON_INTERPRET")
ON_GPU = os.environ.get("DFLASH_TEST_KERNELS_ON_GPU") == "1"
os.environ["TRITON_INTERPRET"] = "0" if ON_GPU else "1"  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed (pip install 'dflash-trt[kernels]')", allow_module_level=True)
if ON_GPU:  # every test here then runs on the GPU: `gpu`, which tests/conftest.py skips where there is none
    pytestmark = pytest.mark.gpu

from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from dflash_trt.decoding import verify  # noqa: E402
from dflash_trt.kernels import (  # noqa: E402
    aot,
    block_draft_attention,
    greedy_accept,
    kernels_available,  # noqa: E402
    kv_inject,
    rejection_accept,
)
from dflash_trt.kernels.inject import kv_inject_kernel  # noqa: E402
from dflash_trt.kernels.reference import block_draft_attention_ref, kv_inject_ref, rope_inv_freq  # noqa: E402


def _restore_interpret():
    if _PREV_INTERPRET is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _PREV_INTERPRET


_restore_interpret()  # other test modules see the environment they had; this module's tests re-set it
if isinstance(kv_inject_kernel, InterpretedFunction) == ON_GPU:
    pytest.skip(
        f"triton was imported before TRITON_INTERPRET={0 if ON_GPU else 1} could take effect; "
        "run this file on its own",
        allow_module_level=True,
    )


@pytest.fixture(autouse=True, scope="module")
def _triton_interpreter():
    os.environ["TRITON_INTERPRET"] = "0" if ON_GPU else "1"
    yield
    _restore_interpret()


def _on_gpu(launcher):
    """launcher run on CUDA copies of its tensor arguments; in-place writes and results come back."""

    def run(*args, **kwargs):
        cpu = [*args, *kwargs.values()]
        moved = [a.cuda() if torch.is_tensor(a) else a for a in cpu]
        out = launcher(*moved[: len(args)], **dict(zip(kwargs, moved[len(args) :])))
        torch.cuda.synchronize()
        back = {}
        for a, m in zip(cpu, moved):
            if torch.is_tensor(a):
                a.copy_(m.cpu())
                back[id(m)] = a

        def home(t):
            return back.get(id(t), t.cpu()) if torch.is_tensor(t) else t

        if isinstance(out, tuple):
            return tuple(home(t) for t in out)
        if isinstance(out, verify.Verdict):
            return verify.Verdict(home(out.accepted), home(out.bonus))
        return home(out)

    return run


if ON_GPU:
    kv_inject, block_draft_attention, greedy_accept, rejection_accept = map(
        _on_gpu, (kv_inject, block_draft_attention, greedy_accept, rejection_accept)
    )

F32, BF16, F16, FP8 = torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn
TOL = {F32: (2e-5, 0.0), BF16: (3e-2, 2e-2), F16: (4e-3, 2e-3)}


def close(out, ref, dtype, scale=1.0):
    if dtype == FP8:  # one e4m3 step: 2^-3 relative, 2^-9 absolute in scaled units
        torch.testing.assert_close(out.float(), ref.float(), atol=2.0**-9 * scale, rtol=0.125)
    else:
        atol, rtol = TOL[dtype]
        torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


def pages_for(R, max_pages, num_pages, seed):
    """A random (non-identity) block table [R, max_pages] over a pool of num_pages pages."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(num_pages, generator=g)[: R * max_pages].view(R, max_pages).int()


def test_kernels_available_under_interpreter():
    assert kernels_available()


# ------------------------------------------------------------------ kv_inject
# (rows, tokens n, n_new per row, H_kv, head_dim, dtype, cache dtype, paged)
INJECT_CASES = [
    (1, 1, [1], 1, 64, F32, F32, False),
    (3, 5, [5, 0, 1], 2, 64, F32, F32, True),
    (4, 9, [9, 1, 0, 4], 2, 128, F32, F32, False),
    (2, 20, [20, 17], 1, 128, F32, F32, True),  # two token tiles
    (2, 7, [7, 1], 2, 64, BF16, BF16, False),
    (3, 6, [0, 6, 1], 2, 128, BF16, BF16, True),
    (2, 5, [5, 2], 2, 64, F16, F16, False),
    (2, 6, [6, 1], 2, 64, F32, FP8, False),
    (2, 6, [3, 6], 1, 64, BF16, FP8, True),
]


def _inject_inputs(R, n, n_new, hkv, D, dtype, L=2, d=48, S=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(R, n, d, generator=g).to(dtype)
    positions = torch.stack([torch.randperm(S, generator=g)[:n] for _ in range(R)])
    wk = (torch.randn(L, hkv * D, d, generator=g) * d**-0.5).to(dtype)
    wv = (torch.randn(L, hkv * D, d, generator=g) * d**-0.5).to(dtype)
    k_norm_w = (torch.rand(L, D, generator=g) + 0.5).to(dtype)
    return h, positions, torch.tensor(n_new), wk, wv, k_norm_w


@pytest.mark.parametrize("R,n,n_new,hkv,D,dtype,cdtype,paged", INJECT_CASES)
def test_kv_inject_matches_reference(R, n, n_new, hkv, D, dtype, cdtype, paged):
    L, S, ps = 2, 32, 8
    h, pos, nn, wk, wv, knw = _inject_inputs(R, n, n_new, hkv, D, dtype, L=L, S=S)
    inv_freq = rope_inv_freq(D, 10000.0)
    bt = pages_for(R, S // ps, R * S // ps + 3, seed=1) if paged else None
    shape = (L, bt.max().item() + 1, hkv, ps, D) if paged else (L, R, hkv, S, D)
    fill = torch.full(shape, 7.0).to(cdtype)  # untouched slots must keep their value
    kc, vc, kr, vr = fill.clone(), fill.clone(), fill.clone(), fill.clone()
    scale = (0.05, 0.02) if cdtype == FP8 else None
    kv_inject(h, pos, nn, wk, wv, knw, inv_freq, kc, vc, eps=1e-6, block_table=bt, kv_scale=scale, block_k=32)
    kv_inject_ref(h, pos, nn, wk, wv, knw, inv_freq, kr, vr, eps=1e-6, block_table=bt, kv_scale=scale)
    close(kc, kr, cdtype if cdtype == FP8 else dtype)
    close(vc, vr, cdtype if cdtype == FP8 else dtype)
    assert (kc.float() == 7.0).sum() == (kr.float() == 7.0).sum()  # same set of slots written


def test_kv_inject_paged_equals_contiguous_and_rope_scaling():
    R, n, hkv, D, L, S, ps = 3, 6, 2, 64, 2, 24, 4
    h, pos, nn, wk, wv, knw = _inject_inputs(R, n, [6, 1, 3], hkv, D, F32, L=L, S=S, seed=3)
    inv_freq = rope_inv_freq(D, 1e6) * 0.5  # any inv_freq table works (e.g. scaled rope)
    kc, vc = torch.zeros(L, R, hkv, S, D), torch.zeros(L, R, hkv, S, D)
    bt = pages_for(R, S // ps, R * S // ps, seed=4)
    kp, vp = torch.zeros(L, R * S // ps, hkv, ps, D), torch.zeros(L, R * S // ps, hkv, ps, D)
    kv_inject(h, pos, nn, wk, wv, knw, inv_freq, kc, vc, rope_scale=1.25)
    kv_inject(h, pos, nn, wk, wv, knw, inv_freq, kp, vp, block_table=bt, rope_scale=1.25)
    p = torch.arange(S)
    for r in range(R):  # gather the paged pool back into per-row contiguous order
        torch.testing.assert_close(
            kp[:, bt[r, p // ps].long(), :, p % ps].permute(1, 2, 0, 3), kc[:, r], atol=0, rtol=0
        )
        torch.testing.assert_close(
            vp[:, bt[r, p // ps].long(), :, p % ps].permute(1, 2, 0, 3), vc[:, r], atol=0, rtol=0
        )
    kr, vr = torch.zeros_like(kc), torch.zeros_like(vc)
    kv_inject_ref(h, pos, nn, wk, wv, knw, inv_freq, kr, vr, rope_scale=1.25)
    close(kc, kr, F32)


# ------------------------------------------------------------------ block attention
# (rows, GQA ratio, H_kv, B, head_dim, dtype, cache dtype, paged, ctx_len per row)
ATTN_CASES = [
    (1, 1, 2, 2, 64, F32, F32, False, [0]),
    (2, 4, 1, 8, 64, F32, F32, True, [1, 37]),
    (3, 1, 2, 16, 128, F32, F32, False, [0, 1, 40]),
    (4, 4, 2, 16, 128, F32, F32, True, [33, 0, 1, 17]),
    (2, 4, 2, 8, 64, BF16, BF16, False, [20, 1]),
    (2, 1, 2, 16, 128, BF16, BF16, True, [0, 45]),
    (2, 4, 1, 2, 64, F16, F16, False, [5, 0]),
    (2, 4, 2, 8, 64, F32, FP8, False, [30, 1]),
    (2, 1, 2, 16, 64, BF16, FP8, True, [0, 29]),
]


def _attn_inputs(R, G, hkv, B, D, dtype, cdtype, paged, S=48, ps=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(R, G * hkv, B, D, generator=g).to(dtype)
    kb, vb = (torch.randn(R, hkv, B, D, generator=g).to(dtype) for _ in range(2))
    if paged:
        bt = pages_for(R, S // ps, R * S // ps + 2, seed + 1)
        kc, vc = (torch.randn(R * S // ps + 2, hkv, ps, D, generator=g).to(cdtype) for _ in range(2))
    else:
        bt = None
        kc, vc = (torch.randn(R, hkv, S, D, generator=g).to(cdtype) for _ in range(2))
    return q, kb, vb, kc, vc, bt


@pytest.mark.parametrize("R,G,hkv,B,D,dtype,cdtype,paged,ctx", ATTN_CASES)
def test_block_attention_matches_reference(R, G, hkv, B, D, dtype, cdtype, paged, ctx):
    q, kb, vb, kc, vc, bt = _attn_inputs(R, G, hkv, B, D, dtype, cdtype, paged)
    ctx_len = torch.tensor(ctx)
    scale = (0.5, 0.25) if cdtype == FP8 else None
    out = block_draft_attention(q, kb, vb, kc, vc, ctx_len, block_table=bt, kv_scale=scale)
    ref = block_draft_attention_ref(q, kb, vb, kc, vc, ctx_len, block_table=bt, kv_scale=scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    close(out, ref, dtype)


def test_block_attention_paged_equals_contiguous_and_stacked_layers():
    R, G, hkv, B, D, S, ps = 3, 2, 2, 8, 64, 40, 8
    q, kb, vb, kc, vc, _ = _attn_inputs(R, G, hkv, B, D, F32, F32, False, S=S, seed=5)
    ctx_len = torch.tensor([40, 0, 19])
    bt = pages_for(R, S // ps, R * S // ps, seed=6)
    kp, vp = torch.zeros(R * S // ps, hkv, ps, D), torch.zeros(R * S // ps, hkv, ps, D)
    p = torch.arange(S)
    for r in range(R):  # scatter the contiguous cache into pages
        kp[bt[r, p // ps].long(), :, p % ps] = kc[r].transpose(0, 1)
        vp[bt[r, p // ps].long(), :, p % ps] = vc[r].transpose(0, 1)
    out_c = block_draft_attention(q, kb, vb, kc, vc, ctx_len)
    out_p = block_draft_attention(q, kb, vb, kp, vp, ctx_len, block_table=bt)
    torch.testing.assert_close(out_p, out_c, atol=1e-6, rtol=0)
    # a stacked [L, ...] cache read at `layer` equals the per-layer cache
    ks, vs = torch.stack([torch.randn_like(kp), kp]), torch.stack([torch.randn_like(vp), vp])
    out_s = block_draft_attention(q, kb, vb, ks, vs, ctx_len, block_table=bt, layer=1)
    torch.testing.assert_close(out_s, out_p, atol=0, rtol=0)


# ------------------------------------------------------------------ accept
def _greedy_case(R, B, V, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(R, B, V, generator=g)
    logits[0, 0] = 0.0  # an all-tie row: argmax must take the first index
    am = logits.argmax(-1)
    draft = torch.cat([torch.randint(0, V, (R, 1), generator=g), am[:, :-1]], dim=1)  # all drafts match
    for r in range(1, R if B > 1 else 1):  # then break row r at a random slot (row 0 stays fully accepted)
        k = int(torch.randint(1, B, (1,), generator=g))
        draft[r, k] = (draft[r, k] + 1 + r) % V
    return draft, logits, am


@pytest.mark.parametrize("R,B,V", [(1, 2, 50), (3, 8, 37), (4, 16, 300), (2, 1, 50)])
def test_greedy_accept_matches_verify(R, B, V):
    draft, logits, am = _greedy_case(R, B, V, seed=B)
    ref = verify.greedy_accept(draft, am)
    for target in (am, am.int(), logits, logits.bfloat16()):
        if target.dtype == BF16:
            ref = verify.greedy_accept(draft, target.float().argmax(-1))
        got = greedy_accept(draft, target)
        assert torch.equal(got.accepted, ref.accepted) and torch.equal(got.bonus, ref.bonus), target.dtype
    assert int(verify.greedy_accept(draft, am).accepted[0]) == B - 1


def test_greedy_accept_stops_at_a_masked_draft():
    """The engine marks drafts past a row's gated length with -1 (decoding/engine.py accept): kernel and
    reference stop there and take the bonus from that position."""
    draft, logits, am = _greedy_case(3, 8, 37, seed=5)
    draft[:, 1:] = am[:, :-1]  # every draft right ...
    draft[0, 3:], draft[1, 1:] = -1, -1  # ... but row 0 judges 2 of them, row 1 none, row 2 all 7
    ref = verify.greedy_accept(draft, am)
    assert ref.accepted.tolist() == [2, 0, 7] and ref.bonus.tolist() == am[[0, 1, 2], [2, 0, 7]].tolist()
    got = greedy_accept(draft, am)
    assert torch.equal(got.accepted, ref.accepted) and torch.equal(got.bonus, ref.bonus)


@pytest.mark.parametrize("R,B,V", [(1, 2, 50), (4, 8, 37), (4, 16, 300), (3, 1, 37)])
def test_rejection_accept_matches_verify(R, B, V):
    g = torch.Generator().manual_seed(V)
    p = torch.softmax(torch.randn(R, B, V, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(R, B - 1, V, generator=g) * 2, -1)
    draft = torch.randint(0, V, (R, B), generator=g)
    u_accept = torch.rand(R, B - 1, generator=g) * 0.2
    u_sample = torch.rand(R, generator=g)
    # B = 1: no drafts (a gated step, decoding/draft_length.py), the bonus is a plain sample from p[0]
    u_accept[0] = 0.0  # row 0: every draft with p > 0 accepted -> bonus from p[B-1]
    if R > 1 and B > 1:
        q[1, 0], u_accept[1, 0] = p[1, 0], 1.0 - 1e-7  # row 1: rejected where p == q -> empty residual
    if R > 2:
        u_sample[2] = 1.0 - 1e-7  # row 2: sample at the very top of the CDF (clamp to V-1 path)
    for rows in (slice(None), slice(0, 1)):
        args = (draft[rows], p[rows], q[rows], u_accept[rows], u_sample[rows])
        got, ref = rejection_accept(*args), verify.rejection_accept(*args)
        assert torch.equal(got.accepted, ref.accepted), (got.accepted, ref.accepted)
        assert torch.equal(got.bonus, ref.bonus), (got.bonus, ref.bonus)


# ------------------------------------------------------------------ AOT
AOT_SPECS = [
    aot.kv_inject_spec("bf16", 64, paged=True, fp8=True),
    aot.attention_spec("bf16", 64, paged=True, fp8=True),
    aot.greedy_spec(None),
    aot.greedy_spec("bf16"),
    aot.rejection_spec("fp32"),
]


def test_default_specs_cover_every_kernel_argument():
    specs = aot.default_specs()
    assert len({s.name for s in specs}) == len(specs)
    assert {s.kernel.rpartition(":")[2] for s in specs} == {
        "kv_inject_kernel",
        "block_attention_kernel",
        "greedy_accept_kernel",
        "rejection_accept_kernel",
    }
    for s in specs:
        args = aot.resolve_kernel(s.kernel).arg_names
        assert set(args) == set(s.types) | set(s.constexprs) and not set(s.types) & set(s.constexprs), s.name


def test_aot_compiles_every_kernel_for_sm90_and_sm100(tmp_path):
    out = tmp_path / "plugins"
    manifest_path = aot.compile_all(["sm_90", "sm_100"], out, specs=AOT_SPECS)
    manifest = aot.load_manifest(out)  # verifies every sha256
    assert manifest_path == out / "manifest.json" and manifest["archs"] == ["sm_90", "sm_100"]
    entries = {(e["name"], e["arch"]): e for e in manifest["kernels"]}
    assert set(entries) == {(s.name, a) for s in AOT_SPECS for a in ("sm_90", "sm_100")}
    for (name, arch), e in entries.items():
        spec = next(s for s in AOT_SPECS if s.name == name)
        assert e["signature"] == spec.types and e["constexprs"] == spec.constexprs
        assert e["num_warps"] == spec.num_warps and e["threads_per_block"] == 32 * spec.num_warps
        assert 0 <= e["shared_mem"] <= 48 * 1024 and e["global_scratch_size"] == 0
        ptx = (out / e["files"]["ptx"]["path"]).read_text()
        assert f".entry {e['entry']}(" in ptx and f".target sm_{arch[3:]}a" in ptx
        assert (out / e["files"]["cubin"]["path"]).read_bytes()[:4] == b"\x7fELF"
        subprocess.run(  # the PTX assembles for the arch with the ptxas Triton ships
            [get_ptxas(int(arch[3:])).path, f"-arch={arch}a", "-o", os.devnull, str(out / e["files"]["ptx"]["path"])],
            check=True,
            capture_output=True,
        )
    assert [p.name for p in tmp_path.iterdir()] == ["plugins"]  # no temp dirs left behind


BROKEN = """
import triton
import triton.language as tl

@triton.jit
def broken_kernel(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(x_ptr + i, undefined_name + i, mask=i < n)
"""


def test_aot_broken_kernel_raises_and_writes_nothing(tmp_path, monkeypatch):
    (tmp_path / "broken_mod.py").write_text(BROKEN)
    monkeypatch.syspath_prepend(str(tmp_path))
    bad = aot.KernelSpec("broken", "broken_mod:broken_kernel", {"x_ptr": "*fp32", "n": "i32"}, {"BLOCK": 64})
    out = tmp_path / "out"
    with pytest.raises(aot.KernelCompileError, match="broken failed to compile for sm_90"):
        aot.compile_all(["sm_90"], out, specs=[AOT_SPECS[2], bad])
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    with pytest.raises(aot.KernelCompileError, match="no type or value"):
        aot.compile_spec(aot.KernelSpec("partial", "broken_mod:broken_kernel", {"x_ptr": "*fp32"}, {}), "sm_90")
    sys.modules.pop("broken_mod", None)


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("DFLASH_TEST_FULL_AOT") != "1", reason="full AOT set takes minutes; " "set DFLASH_TEST_FULL_AOT=1"
)
def test_aot_full_default_set(tmp_path):
    aot.compile_all(["sm_90", "sm_100"], tmp_path / "all", jobs=os.cpu_count() or 1)
    assert len(aot.load_manifest(tmp_path / "all")["kernels"]) == 2 * len(aot.default_specs())
