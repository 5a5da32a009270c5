"""TensorRT quickly-deployable plugins (QDP) for the drafter kernels, AOT flavour.

Boundary: registers `dflash::DFlashKVInject` and `dflash::DFlashBlockAttention` with
`tensorrt.plugin` (trtp.register for shapes/dtypes, trtp.aot_impl for the kernel). aot_impl
returns the Triton kernel's PTX, its entry name, launch geometry and int32 scalar arguments as
symbolic shape expressions, so TensorRT embeds the PTX in the engine and launches it with no
Python at run time. PTX comes from a prebuilt `dflash-trt plugins compile` directory
(DFLASH_TRT_KERNEL_DIR, see aot.py) when it holds the exact specialisation for this GPU, else
it is compiled on the spot with Triton.

tensorrt is not pip-installable here: it runs in the NGC TensorRT-LLM container. Importing this
module never needs it; register_plugins() raises TensorRTUnavailable when it is missing.

Kernel parameter order == TensorRT's AOT launch order: inputs, int32 extra args, outputs.
Caches are inputs aliased to the outputs (written in place; the builder config needs
trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03). Contiguous-layout engines feed a 1-element int32
block_table; non-fp8 caches still take the [2] fp32 kv_scale input. The aot_impl functions
declare every attribute, in register order (some TensorRT versions pass them all positionally).
rope_theta is informational: the kernel reads the inv_freq input, so rope-scaled models work.
NOTE: no `from __future__ import annotations` -- trtp reads these annotations at run time.
"""

import os

import torch

from dflash_trt.kernels import aot

NAMESPACE = "dflash"
KV_INJECT_ID = f"{NAMESPACE}::DFlashKVInject"
BLOCK_ATTENTION_ID = f"{NAMESPACE}::DFlashBlockAttention"
KERNEL_DIR_ENV = "DFLASH_TRT_KERNEL_DIR"
_REGISTERED = False


class TensorRTUnavailable(RuntimeError):
    """tensorrt (with tensorrt.plugin AOT support) is not importable in this environment."""


def tensorrt_available() -> bool:
    try:
        # deferred: optional dependency (only in the NGC TensorRT-LLM container)
        import tensorrt.plugin as trtp
    except Exception:  # ImportError, or a broken CUDA setup raising at import
        return False
    return hasattr(trtp, "aot_impl")


def _require_trt():
    try:
        # deferred: optional dependency (only in the NGC TensorRT-LLM container)
        import tensorrt as trt
        import tensorrt.plugin as trtp
    except Exception as e:
        raise TensorRTUnavailable(
            "DFlash TensorRT plugins need the `tensorrt` Python package, which is not installable "
            "with pip here: run this inside the NGC TensorRT-LLM container "
            "(nvcr.io/nvidia/tensorrt-llm/release), which ships tensorrt with tensorrt.plugin. "
            f"Import failed with: {type(e).__name__}: {e}"
        ) from e
    if not hasattr(trtp, "aot_impl"):
        raise TensorRTUnavailable(
            f"tensorrt {trt.__version__} has no tensorrt.plugin.aot_impl (AOT "
            "quickly-deployable plugins); use a newer NGC TensorRT-LLM container"
        )
    return trt, trtp


def _type_name(trt, dtype) -> str:
    names = {trt.float32: "fp32", trt.float16: "fp16", trt.bfloat16: "bf16", trt.int32: "i32"}
    if hasattr(trt, "fp8"):
        names[trt.fp8] = "fp8e4nv"
    if dtype not in names:
        raise TypeError(f"DFlash plugins do not support TensorRT dtype {dtype}")
    return names[dtype]


def _current_arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major * 10 + minor}"


def kernel_for(spec: aot.KernelSpec, arch: str | None = None) -> tuple[str, str, int, int]:
    """(entry name, PTX text, num_warps, shared bytes) of spec for arch (default: this GPU).

    The PTX is the `.trt.ptx` flavour: exactly (inputs, int32 extras, outputs) parameters.
    """
    arch = f"sm_{aot.arch_number(arch or _current_arch())}"
    root = os.environ.get(KERNEL_DIR_ENV)
    if root:
        for e in aot.load_manifest(root)["kernels"]:
            if (
                e["name"] == spec.name
                and e["arch"] == arch
                and e["constexprs"] == spec.constexprs
                and e["signature"] == spec.types
            ):
                ptx = open(os.path.join(root, e["files"]["trt.ptx"]["path"])).read()
                return e["entry"], ptx, e["num_warps"], e["shared_mem"]
    ck = aot.compile_spec(spec, arch)
    ptx = aot.strip_scratch_params(ck.asm["ptx"], ck.metadata.name, len(spec.types))
    return ck.metadata.name, ptx, ck.metadata.num_warps, ck.metadata.shared


def register_plugins() -> tuple[str, str]:
    """Register both plugins with TensorRT's plugin registry (idempotent); returns their ids."""
    global _REGISTERED
    trt, trtp = _require_trt()
    if _REGISTERED:
        return KV_INJECT_ID, BLOCK_ATTENTION_ID
    TD = trtp.TensorDesc

    def _launch(trt_grid, num_warps, shared, ints):
        lp = trtp.KernelLaunchParams()
        lp.grid_x, lp.grid_y, lp.grid_z = (trtp.SymInt32(g) for g in trt_grid)
        lp.block_x = num_warps * 32
        lp.shared_mem = shared
        return lp, trtp.SymIntExprs.from_tuple([trtp.SymInt32(i) for i in ints])

    # ---- DFlashKVInject: context features -> K/V of all layers, written into the caches ----
    @trtp.register(KV_INJECT_ID)
    def kv_inject_desc(
        h: TD,
        positions: TD,
        n_new: TD,
        wk: TD,
        wv: TD,
        k_norm_w: TD,
        inv_freq: TD,
        block_table: TD,
        kv_scale: TD,
        k_cache: TD,
        v_cache: TD,
        layers: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        block_size: int,
        rope_theta: float,
        cache_layout: str,
        eps: float,
    ) -> tuple[TD, TD]:
        # h [R, n, d]; positions [R, n] i32; n_new [R] i32; wk/wv [L, H_kv*D, d]; k_norm_w [L, D];
        # inv_freq [D/2] f32 (rope_inv_freq(D, rope_theta) or a scaled variant); block_table
        # [R, max_pages] i32; kv_scale [2] f32; caches [L, R|pages, H_kv, S_max|page_size, D]
        return k_cache.aliased(), v_cache.aliased()

    @trtp.aot_impl(KV_INJECT_ID)
    def kv_inject_aot(
        h: TD,
        positions: TD,
        n_new: TD,
        wk: TD,
        wv: TD,
        k_norm_w: TD,
        inv_freq: TD,
        block_table: TD,
        kv_scale: TD,
        k_cache: TD,
        v_cache: TD,
        layers: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        block_size: int,
        rope_theta: float,
        cache_layout: str,
        eps: float,
        outputs: tuple[TD],
        tactic: int,
    ) -> tuple[str | bytes, str | bytes, trtp.KernelLaunchParams, trtp.SymExprs]:
        fp8 = _type_name(trt, k_cache.dtype) == "fp8e4nv"
        spec = aot.kv_inject_spec(_type_name(trt, h.dtype), head_dim, cache_layout == "paged", fp8, eps)
        name, ptx, warps, shared = kernel_for(spec)
        R, N, DM = h.shape_expr[0], h.shape_expr[1], h.shape_expr[2]
        grid = (trtp.cdiv(N, spec.meta["block_t"]), R, layers * kv_heads)
        ints = (N, DM, kv_heads, k_cache.shape_expr[1], k_cache.shape_expr[3], block_table.shape_expr[1])
        return (name, ptx, *_launch(grid, warps, shared, ints))

    # ---- DFlashBlockAttention: block queries vs [row context ; block K/V] of one layer ----
    @trtp.register(BLOCK_ATTENTION_ID)
    def block_attention_desc(
        q: TD,
        k_blk: TD,
        v_blk: TD,
        k_cache: TD,
        v_cache: TD,
        ctx_len: TD,
        block_table: TD,
        kv_scale: TD,
        layers: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        block_size: int,
        rope_theta: float,
        cache_layout: str,
        layer: int,
    ) -> TD:
        # q [R, H, B, D]; k_blk/v_blk [R, H_kv, B, D]; caches [L, R|pages, H_kv, S_max|page_size, D]
        # read at `layer`; ctx_len [R] i32; block_table [R, max_pages] i32; kv_scale [2] f32
        return q.like()

    @trtp.aot_impl(BLOCK_ATTENTION_ID)
    def block_attention_aot(
        q: TD,
        k_blk: TD,
        v_blk: TD,
        k_cache: TD,
        v_cache: TD,
        ctx_len: TD,
        block_table: TD,
        kv_scale: TD,
        layers: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        block_size: int,
        rope_theta: float,
        cache_layout: str,
        layer: int,
        outputs: tuple[TD],
        tactic: int,
    ) -> tuple[str | bytes, str | bytes, trtp.KernelLaunchParams, trtp.SymExprs]:
        fp8 = _type_name(trt, k_cache.dtype) == "fp8e4nv"
        spec = aot.attention_spec(_type_name(trt, q.dtype), head_dim, cache_layout == "paged", fp8, block_size)
        name, ptx, warps, shared = kernel_for(spec)
        R, B = q.shape_expr[0], q.shape_expr[2]
        grid = (trtp.cdiv(B * (heads // kv_heads), spec.constexprs["BLOCK_M"]), kv_heads, R)
        ints = (heads, kv_heads, B, k_cache.shape_expr[1], k_cache.shape_expr[3], block_table.shape_expr[1], layer)
        return (name, ptx, *_launch(grid, warps, shared, ints))

    _REGISTERED = True
    return KV_INJECT_ID, BLOCK_ATTENTION_ID


def add_plugin_layer(network, plugin_id: str, inputs: list, **attrs):
    """Add a registered DFlash plugin to a TensorRT INetworkDefinition (AOT implementation only).

    Uses `tensorrt.plugin.op.<namespace>.<name>` and network.add_plugin(..., aot=True) as in
    TensorRT's quickly-deployable-plugin samples.
    """
    _, trtp = _require_trt()
    register_plugins()
    ns, name = plugin_id.split("::")
    return network.add_plugin(getattr(getattr(trtp.op, ns), name)(*inputs, **attrs), aot=True)
