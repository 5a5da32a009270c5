"""Prepacked CPU linear layers for the target's few-token forwards (decode, verify).

Boundary: CPU inference only. `pack_target` (and `pack_hf_model`, for the bench's HF assistant)
swaps a model's nn.Linear modules (attention and MLP projections, the LM head) for `PackedLinear`,
which holds the weight once in oneDNN's blocked layout and runs `mkldnn_linear`: still an fp32 GEMM.
Only float32 weights are packed (the CPU's generation dtype): bf16 linears already go through oneDNN,
and packing them gained nothing here. Training, quantisation calibration and anything that needs the
modules' parameters load the target unpacked (api.load_target(packed=False)). A drafter loaded
next to a packed target (api.load_drafter) is packed too (`pack_drafter`), keeping its weights
registered; a drafter being trained never is.

Why: with the weight in nn.Linear's [out, in] layout, F.linear's few-row fp32 products on this CPU
(1 row to decode, B rows to verify) run far below memory speed: eight 896x4864 weights took 7.2 ms
for 1 row and 14.9 ms for 16 (2-core AMD EPYC), prepacked 3.3 and 9.3. Whole forwards, 300-token
context: Qwen2.5-Coder-0.5B 112 ms for 1 token and 259 ms for 16, packed 70 and 110; the 1.5B 274 /
714 ms against 176 / 310. Decoding gets faster and a verify block costs far
fewer decode steps, which is what speculative decoding on a CPU pays for.
"""

from __future__ import annotations

import copy
import os

import torch
from torch import nn

ENV_SWITCH = "DFLASH_TRT_CPU_PACK"  # "0": never pack (A/B comparisons, debugging)


def pack_unavailable_reason(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why the target cannot be packed here (None: it can)."""
    if torch.device(device).type != "cpu":
        return f"device {device} is not the CPU"
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return f"{ENV_SWITCH}=0"
    if not torch.backends.mkldnn.is_available():
        return "this PyTorch build has no oneDNN (mkldnn)"
    if dtype != torch.float32:
        # bf16 F.linear already runs through oneDNN: packed it measured 0.91-0.98x here (M = 1..512)
        return f"dtype {dtype}: packing pays for float32 weights only"
    return None


class PackedLinear(nn.Module):
    """nn.Linear's forward with the weight prepacked for oneDNN; no trainable parameters.

    `weight` stays available as the dense tensor when keep_dense (the LM head: the drafter reads it;
    with tied embeddings it is the embedding table). The packed head is then a second copy of the
    head: 0.5 GB for the 0.5B coder and 0.9 GB for the 1.5B in fp32, the price of packing it.
    register_dense keeps weight and bias as this module's own parameters, so state_dict and
    save_pretrained see the same keys as before packing (the drafter: it is small, and bench and
    serving may save the drafter they run)."""

    def __init__(self, linear: nn.Linear, keep_dense: bool = False, register_dense: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        self._packed_w = w.to_mkldnn()
        self._packed_b = None if linear.bias is None else linear.bias.detach().to_mkldnn()
        self._dtype = w.dtype
        self._registered = register_dense
        if register_dense:
            self.weight, self.bias = linear.weight, linear.bias
        else:  # the original tensor, not registered (not in state_dict): a tied embedding stays shared
            object.__setattr__(self, "weight", linear.weight if keep_dense else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        x2 = x.reshape(-1, self.in_features).to(self._dtype).contiguous()
        y = torch._C._nn.mkldnn_linear(x2.to_mkldnn(), self._packed_w, self._packed_b).to_dense()
        return y.reshape(*x.shape[:-1], self.out_features)

    def __deepcopy__(self, memo) -> PackedLinear:
        # oneDNN tensors have no storage for copy.deepcopy to copy: rebuild from their dense form
        lin = nn.Linear(self.in_features, self.out_features, bias=self._packed_b is not None, dtype=self._dtype)
        with torch.no_grad():
            # a kept dense weight goes through memo, so a tied embedding stays tied in the copy
            w = copy.deepcopy(self.weight, memo) if self.weight is not None else self._packed_w.to_dense()
            lin.weight = w if isinstance(w, nn.Parameter) else nn.Parameter(w, requires_grad=False)
            if self._packed_b is not None:
                lin.bias.copy_(self._packed_b.to_dense())
        return PackedLinear(lin, keep_dense=self.weight is not None, register_dense=self._registered)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self._packed_b is not None}, dtype={self._dtype}, packed=oneDNN"
        )


def _swap(module: nn.Module, register_dense: bool = False) -> int:
    n = 0
    for name, child in module.named_children():
        if type(child) is nn.Linear:  # subclasses (quantised or LoRA linears) keep their own forward
            setattr(module, name, PackedLinear(child, register_dense=register_dense))
            n += 1
        else:
            n += _swap(child, register_dense)
    return n


def pack_hf_model(model: nn.Module) -> int:
    """Pack a Hugging Face causal LM in place: every plain nn.Linear under model.model and the LM
    head (kept dense too: shared with the drafter, or the tied embedding). Returns how many."""
    n = _swap(model.model)
    if type(model.lm_head) is nn.Linear:
        model.lm_head = PackedLinear(model.lm_head, keep_dense=True)
        n += 1
    return n


def packed_matrix(w: torch.Tensor) -> PackedLinear:
    """x @ w.T as a packed linear (w [out, in], e.g. the LM head's draft-vocabulary rows)."""
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
    lin.weight = nn.Parameter(w, requires_grad=False)
    return PackedLinear(lin)


def pack_drafter(drafter: nn.Module) -> int:
    """Pack a drafter's own linears (fc and its layers) in place for inference next to a packed
    target; its head_logits then uses the target's packed LM head, or a packed copy of its
    draft-vocabulary rows. Weights stay registered, so the packed drafter still saves. Measured:
    the 1.5B coder's 1-layer drafter drafted a 4-token block in 21.4 ms unpacked (17.5 of them in
    the layer's F.linear products) and in 7.8 ms packed."""
    n = _swap(drafter, register_dense=True)
    drafter.packed = True
    return n


def pack_target(target) -> int:
    """Pack the target's HF model in place (so HF generate() on target.hf runs the same packed
    modules as our engine). The caller checks pack_unavailable_reason first."""
    n = pack_hf_model(target.hf)
    target.lm_head = target.hf.lm_head
    target.packed = True
    return n
