"""Ahead-of-time compilation of the DFlash Triton kernels to cubin + PTX for given GPU archs.

Boundary: KernelSpec (which kernel, which specialisation) -> files on disk + manifest.json.
Needs Triton (its wheel ships ptxas) but no GPU: triton.compile(ASTSource(...), target=
GPUTarget("cuda", cc, 32)) lowers for any NVIDIA arch from a CPU-only machine. Under
TRITON_INTERPRET=1 Triton's own @jit library (tl.max, tl.sum, ...) is interpreted and cannot be
compiled, so compile_all then compiles in spawned worker processes with the interpreter off.

Output layout (written to a temp dir next to out_dir, then renamed into place):
  out_dir/manifest.json             one entry per (spec, arch): kernel, entry symbol, signature,
                                    constexprs, arch, num_warps, shared mem, scratch, files+sha256
  out_dir/<arch>/<spec>.ptx|.cubin  Triton's output

What it is for: proving on a CPU-only machine (CI, an image build) that every kernel
specialisation the PyTorch engine launches on Hopper / Blackwell compiles for those archs, and
shipping the compiled files with a checksummed manifest. The engine itself JIT-compiles through
Triton's cache at first use; nothing loads these files at run time.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path

from dflash_trt.atomic import atomic_dir

ARCHS = ("sm_90", "sm_100", "sm_120")
MANIFEST = "manifest.json"
_MOD = "dflash_trt.kernels."


class KernelCompileError(RuntimeError):
    """A kernel specialisation failed to compile for an arch."""


@dataclass(frozen=True)
class KernelSpec:
    name: str  # unique artifact name, e.g. "block_attention_bf16_d128_paged_fp8"
    kernel: str  # "module:attr" of the @triton.jit function (importable, so specs pickle)
    types: dict  # runtime argument -> Triton type ("*bf16", "*i32", "i32", ...)
    constexprs: dict  # tl.constexpr argument -> value
    num_warps: int = 4
    num_stages: int = 2
    meta: dict = field(default_factory=dict)  # free-form facts for consumers (dtype, head_dim, ...)


def _ptr(t: str) -> str:
    return "*" + t


def _signature(*runs: tuple[str, str]) -> dict:
    """Runtime argument -> Triton type, in the kernel's argument order, from (type, "arg arg ...") runs."""
    return {arg: t for t, args in runs for arg in args.split()}


def _cache_kernel_spec(
    prefix: str, kernel: str, types: dict, const: dict, dtype: str, head_dim: int, paged: bool, fp8: bool, **meta
) -> KernelSpec:
    """A spec of a kernel over the drafter KV cache (kv_inject, block_attention): the cache layout
    (contiguous or paged, fp8 or not) is part of its name, its constexprs and its meta."""
    return KernelSpec(
        f"{prefix}_{'paged' if paged else 'contig'}{'_fp8' if fp8 else ''}",
        _MOD + kernel,
        types,
        dict(D=head_dim, **const, PAGED=paged, FP8=fp8, INTERPRET=False),
        meta=dict(dtype=dtype, head_dim=head_dim, paged=paged, fp8=fp8, **meta),
    )


def kv_inject_spec(
    dtype: str = "bf16",
    head_dim: int = 128,
    paged: bool = False,
    fp8: bool = False,
    eps: float = 1e-6,
    rope_scale: float = 1.0,
) -> KernelSpec:
    t, c = _ptr(dtype), _ptr("fp8e4nv" if fp8 else dtype)
    types = _signature(
        (t, "h_ptr"),
        ("*i32", "pos_ptr nnew_ptr"),
        (t, "wk_ptr wv_ptr knw_ptr"),
        ("*fp32", "invf_ptr"),
        ("*i32", "bt_ptr"),
        ("*fp32", "scale_ptr"),
        (c, "kin_ptr vin_ptr"),
        ("i32", "N DM HKV NSEQ S MAXP"),
        (c, "kout_ptr vout_ptr"),
    )
    const = dict(BLOCK_T=16, BLOCK_K=64, EPS=float(eps), ROPE_SCALE=float(rope_scale))
    name = f"kv_inject_{dtype}_d{head_dim}"
    return _cache_kernel_spec(name, "inject:kv_inject_kernel", types, const, dtype, head_dim, paged, fp8, block_t=16)


def attention_spec(
    dtype: str = "bf16", head_dim: int = 128, paged: bool = False, fp8: bool = False, block_size: int = 16
) -> KernelSpec:
    t, c = _ptr(dtype), _ptr("fp8e4nv" if fp8 else dtype)
    types = _signature(
        (t, "q_ptr kb_ptr vb_ptr"),
        (c, "kc_ptr vc_ptr"),
        ("*i32", "ctx_ptr bt_ptr"),
        ("*fp32", "scale_ptr"),
        ("i32", "H HKV B NSEQ S MAXP LAYER"),
        (t, "o_ptr"),
    )
    block_b = max(16, 1 << (block_size - 1).bit_length())
    # BLOCK_N 32 at head_dim 128 keeps shared memory under the 48 KiB default launch limit
    const = dict(BLOCK_M=64, BLOCK_N=64 if head_dim <= 64 else 32, BLOCK_B=block_b, SM_SCALE=head_dim**-0.5)
    name, meta = f"block_attention_{dtype}_d{head_dim}_b{block_b}", dict(max_block_size=block_b, block_m=64)
    return _cache_kernel_spec(
        name, "attention:block_attention_kernel", types, const, dtype, head_dim, paged, fp8, **meta
    )


def greedy_spec(logits_dtype: str | None = None) -> KernelSpec:
    """Token ids are int32; logits_dtype None means the target argmax is an input."""
    t = _ptr(logits_dtype) if logits_dtype else "*i32"
    types = dict(draft_ptr="*i32", t_ptr=t, B="i32", V="i32", acc_ptr="*i32", bonus_ptr="*i32")
    const = dict(BLOCK_B=32, BLOCK_V=256, FROM_LOGITS=logits_dtype is not None)
    name = f"greedy_accept_{'logits_' + logits_dtype if logits_dtype else 'argmax'}"
    return KernelSpec(
        name, _MOD + "accept:greedy_accept_kernel", types, const, num_warps=8, meta=dict(max_block_size=32)
    )


def rejection_spec(prob_dtype: str = "fp32") -> KernelSpec:
    types = _signature(
        ("*i32", "draft_ptr"),
        (_ptr(prob_dtype), "p_ptr q_ptr"),
        ("*fp32", "ua_ptr us_ptr"),
        ("i32", "B V"),
        ("*i32", "acc_ptr bonus_ptr"),
    )
    return KernelSpec(
        f"rejection_accept_{prob_dtype}",
        _MOD + "accept:rejection_accept_kernel",
        types,
        dict(BLOCK_B=32, BLOCK_V=1024),
        num_warps=4,
        meta=dict(max_block_size=32),
    )


def default_specs() -> list[KernelSpec]:
    """The fixed set `dflash-trt kernels compile` builds: 16-bit models at head_dim 64/128,
    contiguous and paged caches, fp8 caches for bf16 models, block size up to 16."""
    specs = []
    for dt in ("bf16", "fp16"):
        for d in (64, 128):
            for paged in (False, True):
                for fp8 in ((False, True) if dt == "bf16" else (False,)):
                    specs.append(kv_inject_spec(dt, d, paged, fp8))
                    specs.append(attention_spec(dt, d, paged, fp8, block_size=16))
    specs += [greedy_spec(None), greedy_spec("fp32"), greedy_spec("bf16"), rejection_spec("fp32")]
    return specs


def arch_number(arch: str | int) -> int:
    """'sm_90' / 'sm_90a' / '90' / 90 -> 90."""
    s = str(arch).lower().removeprefix("sm_").rstrip("af")
    if not s.isdigit():
        raise ValueError(f"bad arch {arch!r}; expected e.g. 'sm_90'")
    return int(s)


def resolve_kernel(ref):
    """'module:attr' (or a kernel object) -> a JITFunction, also under TRITON_INTERPRET=1."""
    # deferred: optional dependency (the `kernels` extra)
    from triton.runtime.jit import JITFunction

    fn = ref
    if isinstance(ref, str):
        mod, _, attr = ref.partition(":")
        fn = getattr(importlib.import_module(mod), attr)
    if not isinstance(fn, JITFunction):  # the interpreter's InterpretedFunction wraps the Python function
        fn = JITFunction(fn.fn)
    return fn


def compile_spec(spec: KernelSpec, arch: str | int):
    """Compile one specialisation for one arch; returns Triton's CompiledKernel."""
    # deferred: optional dependency (the `kernels` extra)
    import triton
    from triton.backends.compiler import GPUTarget

    fn = resolve_kernel(spec.kernel)
    missing = [a for a in fn.arg_names if a not in spec.types and a not in spec.constexprs]
    if missing:
        raise KernelCompileError(f"{spec.name}: no type or value for arguments {missing}")
    if _interpreting():
        raise KernelCompileError(
            "cannot compile in a process with TRITON_INTERPRET=1 (Triton's library "
            "functions are interpreted there); use compile_all, which spawns workers"
        )
    signature = {a: ("constexpr" if a in spec.constexprs else spec.types[a]) for a in fn.arg_names}
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=dict(spec.constexprs))
    opts = dict(num_warps=spec.num_warps, num_stages=spec.num_stages, enable_fp_fusion=True)
    return triton.compile(src, target=GPUTarget("cuda", arch_number(arch), 32), options=opts)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _worker_init() -> None:
    """Spawned compile workers: real compilation, never the interpreter (set before importing triton)."""
    if "triton" in sys.modules:
        raise RuntimeError("triton was imported before the compile worker could turn TRITON_INTERPRET off")
    os.environ["TRITON_INTERPRET"] = "0"


def _compile_to_files(spec: KernelSpec, arch: str, root: str) -> dict:
    """Worker: compile, write <root>/<arch>/<spec>.{ptx,cubin}, return the manifest entry."""
    try:
        ck = compile_spec(spec, arch)
    except KernelCompileError:
        raise
    except Exception as e:  # Triton raises CompilationError, RuntimeError (ptxas), ...
        raise KernelCompileError(f"{spec.name} failed to compile for {arch}: {type(e).__name__}: {e}") from None
    md = ck.metadata
    files = {}
    for ext, data in (("ptx", ck.asm["ptx"].encode()), ("cubin", bytes(ck.asm["cubin"]))):
        rel = f"{arch}/{spec.name}.{ext}"
        Path(root, rel).write_bytes(data)
        files[ext] = {"path": rel, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    return {
        "name": spec.name,
        "kernel": spec.kernel.rpartition(":")[2],
        "entry": md.name,
        "arch": arch,
        "signature": dict(spec.types),
        "constexprs": dict(spec.constexprs),
        "num_warps": md.num_warps,
        "num_stages": spec.num_stages,
        "threads_per_block": md.num_warps * 32,
        "shared_mem": md.shared,
        "global_scratch_size": getattr(md, "global_scratch_size", 0),
        "profile_scratch_size": getattr(md, "profile_scratch_size", 0),
        "meta": dict(spec.meta),
        "files": files,
    }


def compile_all(
    archs=ARCHS,
    out_dir: str | os.PathLike = "kernels_build",
    specs: list[KernelSpec] | None = None,
    jobs: int = 1,
    progress=None,
) -> Path:
    """Compile every spec (default_specs()) for every arch into out_dir; returns the manifest path.

    progress, if given, is called with each manifest entry as it completes (in work order).

    Any failure raises KernelCompileError and leaves out_dir untouched. jobs > 1 (and any call
    under TRITON_INTERPRET=1) compiles in that many spawned processes, so specs must name
    importable kernels and scripts calling this need the usual `if __name__ == "__main__":` guard.
    """
    # deferred: optional dependency (the `kernels` extra)
    import triton

    specs = default_specs() if specs is None else list(specs)
    archs = [f"sm_{arch_number(a)}" for a in archs]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError("spec names must be unique")
    out = Path(out_dir)
    with atomic_dir(out) as tmp:  # dflash_trt/atomic.py: an earlier out_dir is replaced only on success
        for a in archs:
            (tmp / a).mkdir(parents=True)
        work = [(s, a) for a in archs for s in specs]
        if jobs > 1 or _interpreting():
            with ProcessPoolExecutor(max(1, jobs), mp_context=get_context("spawn"), initializer=_worker_init) as pool:
                entries = [
                    _report(e, progress) for e in pool.map(_compile_to_files, *zip(*work), [str(tmp)] * len(work))
                ]
        else:
            entries = [_report(_compile_to_files(s, a, str(tmp)), progress) for s, a in work]
        manifest = {
            "format": 1,
            "triton_version": triton.__version__,
            "archs": archs,
            "specs": [asdict(s) for s in specs],
            "kernels": entries,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return out / MANIFEST


def _report(entry: dict, progress) -> dict:
    if progress is not None:
        progress(entry)
    return entry


def load_manifest(out_dir: str | os.PathLike, verify: bool = True) -> dict:
    """Read manifest.json; with verify, check every file's sha256 (raises ValueError on mismatch)."""
    root = Path(out_dir)
    manifest = json.loads((root / MANIFEST).read_text())
    if verify:
        for e in manifest["kernels"]:
            for f in e["files"].values():
                if hashlib.sha256((root / f["path"]).read_bytes()).hexdigest() != f["sha256"]:
                    raise ValueError(f"{f['path']}: sha256 mismatch")
    return manifest
