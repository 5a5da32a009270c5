"""Kernel switch for the PyTorch engine: the drafter and acceptance on the Triton kernels.

Boundary: the one place that knows how the engine's tensors map onto dflash_trt.kernels'
launchers. The plain-PyTorch code in modeling/drafter.py and decoding/verify.py stays the reference
(and the default on CPU); this module only adapts layouts and dispatches:

  kernels="torch"   the reference path everywhere.
  kernels="triton"  drafter context injection -> kernels.kv_inject (all layers, one launch),
                    drafter block attention     -> kernels.block_draft_attention,
                    acceptance                  -> kernels.greedy_accept / rejection_accept
                                                   (decoding/verify.py accept_ops picks them by resolve()).
                    Anything that cannot run raises DFlashError naming the reason.
  kernels="auto"    "triton" when kernels_available() and the model is on a CUDA device and the
                    drafter's shapes are supported; otherwise "torch" (never an error).
  kernels="auto"    the default of generate(), SpecEngine and the CLI since scripts/gpu_check.sh passed
                    on a GPU (docs/performance.md#gpu-kernel-check-nvidia-h200-2026-12-04): unchanged on CPU.

Layouts: kv_inject writes every layer in one launch, so the drafter cache of the Triton path is
a StackedKVCache: one contiguous [L, R, H_kv, S_max, D] tensor per K and V whose per-layer
views are what KVCache.k[i] / v[i] return (the torch code reads and writes it unchanged).
Slot == absolute position and per-row `lengths` are the same as in KVCache; block attention
reads context slots < lengths[r] and the block's own K/V from registers, so the block is never
written into the cache. The layers' k_proj / v_proj / k_norm weights are stacked once per
weight version ([L, H_kv*D, d], [L, D]); RoPE is the drafter's own inv_freq table and
attention scaling, so scaled-rope drafters match too.
"""

from __future__ import annotations

import torch

from dflash_trt import kernels
from dflash_trt.errors import DFlashError
from dflash_trt.families.capabilities import caps_of
from dflash_trt.kernels import interpreting, triton_available
from dflash_trt.modeling.cache import KVCache

MODES = ("auto", "triton", "torch")


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise DFlashError(f"kernels={mode!r}: expected one of {', '.join(MODES)}")
    return mode


def triton_unavailable_reason(device: torch.device | str) -> str | None:
    """Why the Triton launchers cannot run on `device` here (None when they can)."""
    device = torch.device(device)
    if not triton_available():
        return "Triton is not installed (pip install 'dflash-trt[kernels]')"
    if device.type == "cuda":
        return None if torch.cuda.is_available() else "CUDA is not available"
    if interpreting():
        return None  # Triton's CPU interpreter (tests, gpu_check.py --dry-run)
    return f"the model is on {device.type}; the kernels need a CUDA device (or TRITON_INTERPRET=1 for tests)"


def resolve(mode: str, device: torch.device | str) -> str:
    """'auto' | 'triton' | 'torch' -> 'triton' or 'torch' for a model on `device`.

    auto picks triton only on CUDA devices; explicit triton raises DFlashError when it cannot run.
    """
    check_mode(mode)
    if mode == "torch":
        return "torch"
    reason = triton_unavailable_reason(device)
    if mode == "auto":
        return "triton" if reason is None and torch.device(device).type == "cuda" else "torch"
    if reason is not None:
        raise DFlashError(f"kernels='triton': {reason}; use kernels='torch' (or 'auto')")
    return "triton"


# ---- drafter ------------------------------------------------------------------------------
class StackedKVCache(KVCache):
    """KVCache whose per-layer K/V are views of one contiguous [L, R, H_kv, S_max, D] tensor each."""

    def _allocate(self, num_layers: int, shape: tuple, dtype: torch.dtype, device) -> None:
        shape = (num_layers, *shape)  # [L, R, H_kv, S_max, D]: kv_inject writes every layer in one launch
        self._set(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    def _set(self, k_all: torch.Tensor, v_all: torch.Tensor) -> None:
        self.k_all, self.v_all = k_all.contiguous(), v_all.contiguous()
        self.k, self.v = list(self.k_all.unbind(0)), list(self.v_all.unbind(0))

    def select_rows(self, rows: torch.Tensor) -> None:
        self._set(self.k_all[:, rows], self.v_all[:, rows])
        self.lengths = self.lengths[rows]

    def extend(self, other: KVCache) -> None:
        if other.max_len != self.max_len or len(other.k) != len(self.k):
            raise ValueError(f"cannot join caches of max_len {other.max_len} and {self.max_len}")
        ok, ov = (
            (other.k_all, other.v_all)
            if isinstance(other, StackedKVCache)
            else (torch.stack(other.k), torch.stack(other.v))
        )
        self._set(torch.cat([self.k_all, ok], dim=1), torch.cat([self.v_all, ov], dim=1))
        self.lengths = torch.cat([self.lengths, other.lengths])


def drafter_unsupported_reason(cfg) -> str | None:
    """Why the drafter kernels cannot serve a drafter config (None when they can)."""
    if not caps_of(cfg.family).kernels:  # auto routes it to the PyTorch path (and so no CUDA graph)
        return (
            f"architectures {cfg.architectures}: the drafter kernels implement plain DFlash, not {cfg.family.LABEL} "
            f"(its CAPS.kernels is false)"
        )
    D = cfg.head_dim
    if D < 32 or D & (D - 1):
        return f"head_dim={D}: the drafter kernels need a power of two >= 32"
    if cfg.attention_bias:
        return "attention_bias=true: the drafter kernels have no k_proj / v_proj bias"
    if not cfg.plain_attention:  # input_embedding_scale and the logit fields run outside the kernels
        return (
            "causal or sliding-window drafter layers (is_causal / layer_types): "
            "the block attention kernel has no mask"
        )
    return None


class TritonDrafterOps:
    """The drafter's two hot operations on the Triton kernels (see the module docstring)."""

    def __init__(self, drafter):
        reason = drafter_unsupported_reason(drafter.config)
        if reason is not None:
            raise DFlashError(f"kernels='triton': {reason}; use kernels='torch' (or 'auto')")
        self.drafter = drafter
        self._kv_inject = kernels.kv_inject
        self._attention = kernels.block_draft_attention
        self._weights_key = None
        self._weights = None

    def new_cache(self, *args, **kwargs) -> StackedKVCache:
        return StackedKVCache(*args, **kwargs)

    def _stacked_weights(self):
        """([L, H_kv*D, d] k_proj, v_proj, [L, D] k_norm), re-stacked when a weight changes."""
        attns = [layer.self_attn for layer in self.drafter.layers]
        params = [p for a in attns for p in (a.k_proj.weight, a.v_proj.weight, a.k_norm.weight)]
        key = tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in params)
        if key != self._weights_key:
            self._weights = (
                torch.stack([a.k_proj.weight for a in attns]).detach(),
                torch.stack([a.v_proj.weight for a in attns]).detach(),
                torch.stack([a.k_norm.weight for a in attns]).detach(),
            )
            self._weights_key = key
        return self._weights

    @staticmethod
    def _check_cache(cache) -> StackedKVCache:
        if not isinstance(cache, StackedKVCache):
            raise DFlashError(
                "the drafter kernels need the cache made by drafter.new_cache() after "
                "use_kernels('triton') (a stacked [L, R, H_kv, S, D] cache); "
                f"got {type(cache).__name__}"
            )
        return cache

    def inject(self, ctx: torch.Tensor, positions: torch.Tensor, num_new: torch.Tensor, cache) -> None:
        """ctx [R, n, d] fused context features at positions [R, n]; first num_new[r] are valid."""
        cache = self._check_cache(cache)
        wk, wv, knw = self._stacked_weights()
        rotary = self.drafter.rotary
        self._kv_inject(
            ctx,
            positions,
            num_new,
            wk,
            wv,
            knw,
            rotary.inv_freq,
            cache.k_all,
            cache.v_all,
            eps=self.drafter.config.rms_norm_eps,
            rope_scale=rotary.attention_scaling,
        )

    def block_attention(self, cache):
        """attend(layer, q [R, H, B, D], k, v [R, H_kv, B, D]) -> [R, H, B, D] for one block."""
        cache = self._check_cache(cache)
        ctx_len = cache.lengths.to(torch.int32)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return self._attention(q, k, v, cache.k_all, cache.v_all, ctx_len, layer=i)

        return attend


def drafter_ops(drafter, mode: str):
    """TritonDrafterOps for the drafter, or None for the torch path (mode as resolve())."""
    check_mode(mode)
    if mode == "torch":
        return None
    device = drafter.fc.weight.device
    if mode == "auto" and (resolve("auto", device) == "torch" or drafter_unsupported_reason(drafter.config)):
        return None
    resolve("triton", device)  # raises with the reason when the kernels cannot run here
    return TritonDrafterOps(drafter)
