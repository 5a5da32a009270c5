"""Target adapter: a Hugging Face causal LM (Qwen2, Qwen3, Llama families) run by our own
attention over a croppable per-row KV cache.

Boundary: weights, norms, MLPs and rotary tables are the Hugging Face modules themselves (so
every RoPE variant and checkpoint quirk transformers handles is handled here); what this module
owns is the attention over `KVCache` and the outputs speculative decoding needs: logits at the
positions asked for, and the hidden states of the tapped layers: transformers'
`hidden_states[i + 1]` for tap `i`, as the DFlash reference and vLLM read them, i.e. the output
of decoder layer `i`, except for the last layer (i = L-1), whose entry is after the final norm.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trt.errors import CheckpointError, DFlashError
from dflash_trt.modeling import step_ops
from dflash_trt.modeling.cache import KVCache
from dflash_trt.modeling.stop_ids import model_stop_ids, tokenizer_stops

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [R, H, n, D]; cos/sin [R, n, D] (Hugging Face rotate_half convention)."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def cached_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """q [R, H, n, D] against k/v [R, H_kv, S, D] where visible [R, n, S] is True (None: all); -> [R, H, n, D]."""
    # enable_gqa instead of repeat_interleave: materialising the repeated K/V was ~70% of a CPU decode step
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=None if visible is None else visible[:, None],
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [R, m, V] at the requested positions (float32)
    taps: torch.Tensor | None  # [R, n, n_taps * d] tapped hidden states of every input position


class TargetModel(nn.Module):
    """The target LLM as speculative decoding needs it: ragged batched forward over a KV cache."""

    def __init__(self, hf_model: nn.Module, folder: str | Path | None = None):
        """folder: the model folder, whose tokenizer files add to the default stop ids (stop_ids)."""
        super().__init__()
        cfg = hf_model.config
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise DFlashError(
                f"target model_type={cfg.model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        self.hf = hf_model.eval()
        self.config = cfg
        base = hf_model.model
        self.embed_tokens, self.layers, self.norm = base.embed_tokens, base.layers, base.norm
        self.rotary_emb, self.lm_head = base.rotary_emb, hf_model.lm_head
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.scale = getattr(attn, "scaling", self.head_dim**-0.5)
        self.has_qk_norm = hasattr(attn, "q_norm")
        self.packed = False  # linear weights prepacked for the CPU (modeling/cpu_pack.py)
        self.tokenizer_stops = tokenizer_stops(folder) if folder is not None else ({}, None)
        for p in self.parameters():
            p.requires_grad_(False)

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls, path: str | Path, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu"
    ) -> TargetModel:
        # deferred: transformers takes ~0.6 s to import, and `dflash-trt --help` imports this module
        from transformers import AutoConfig, AutoModelForCausalLM

        path = Path(path)
        if not (path / "config.json").is_file():
            raise CheckpointError(
                f"{path}: no config.json; expected a Hugging Face model folder "
                f"(or a name known to `dflash-trt models list`)"
            )
        cfg = AutoConfig.from_pretrained(path)
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise DFlashError(
                f"{path}: model_type={cfg.model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        try:
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        except (OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{path}: cannot load the target weights ({type(e).__name__}: {e})") from None
        return cls(hf.to(device), path)

    @property
    def stop_ids(self) -> frozenset[int]:
        """The ids that end generation by default (decoding/stopping.py model_stop_ids); computed on
        each read, so a config edited after load (tests, benchmarks) still counts."""
        return model_stop_ids(self.config, getattr(self.hf, "generation_config", None), *self.tokenizer_stops)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    def max_context(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 32768))

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache(self.num_layers, batch, self.num_kv_heads, self.head_dim, max_len, self.dtype, self.device)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head on pre-norm hidden states [..., d] -> float32 logits [..., V]."""
        return step_ops.linear(self.lm_head, step_ops.rms_norm(self.norm, hidden)).float()

    # ---- forward ------------------------------------------------------------------------
    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        tap_layers: list[int] | None = None,
        logits_at: torch.Tensor | None = None,
        tree: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> TargetOutput:
        """Append input_ids [R, n] to every row at positions cache.lengths[r] + 0..n-1.

        Advances cache.lengths by n; the caller crops rows that hold padding or rejected drafts.
        logits_at [R, m] selects the positions (0..n-1 within this input) to compute logits for;
        None means all n. tap_layers lists the decoder layers whose outputs are returned (the last
        layer's after the final norm, as transformers' hidden_states[L] is).
        tree: (depth [R, n], ancestors [R, n, n] bool) when the n tokens are a token tree rather than a
        chain (decoding/tree.py): token j still goes to slot lengths + j, but its RoPE position is
        lengths + depth[r, j] and it sees the cache and the new tokens i with ancestors[r, j, i] (itself
        included), so every node is computed as if its root-to-node path alone had been appended.
        """
        R, n = input_ids.shape
        cache.check_room(n)
        slots = cache.lengths[:, None] + torch.arange(n, device=input_ids.device)  # [R, n]
        upto = int(slots.max()) + 1
        if tree is None:
            positions = slots
            visible = torch.arange(upto, device=input_ids.device)[None, None, :] <= positions[:, :, None]
        else:
            positions, visible = _tree_mask(cache.lengths, tree, n, upto)
        if R == 1 and tree is None and n == 1:
            visible = None  # one token appended to one row sees every slot < upto: no mask to build or apply
        x = self.embed_tokens(input_ids)
        rot = self.rotation(x, positions)  # shared by every layer
        # one row: its n slots are contiguous, so the cache takes a slice copy instead of a scatter
        at = int(cache.lengths[0]) if R == 1 else None
        taps = []
        want = set(tap_layers or [])
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            h = step_ops.rms_norm(layer.input_layernorm, x)
            x = x + self._attention(layer, h, i, cache, slots, upto, visible, rot, at)
            x = x + step_ops.mlp(layer.mlp, step_ops.rms_norm(layer.post_attention_layernorm, x))
            if i in want:
                taps.append(step_ops.rms_norm(self.norm, x) if i == last else x)
        cache.lengths = cache.lengths + n
        tapped = None
        if tap_layers:
            by_id = dict(zip(sorted(want), taps))
            tapped = torch.cat([by_id[i] for i in tap_layers], dim=-1)
        if logits_at is not None:
            x = x.gather(1, logits_at[:, :, None].expand(-1, -1, x.shape[-1]))
        return TargetOutput(logits=self.logits(x), taps=tapped)

    def rotation(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [R, n, d], positions [R, n] -> (cos, signed sin) [R, n, 1, D], what _attention's rope takes."""
        cos, sin = self.rotary_emb(x, positions)  # [R, n, D]
        return cos[:, :, None], step_ops.signed_sin(sin)[:, :, None]

    def _attention(self, layer, h, i, cache, slots, upto, visible, rot, at):
        """h [R, n, d] normed input of layer i; rot = (cos, signed sin) [R, n, 1, D]; at: the first new
        slot when R == 1 (else None: scatter at slots [R, n])."""
        attn = layer.self_attn
        R, n, _ = h.shape
        q = step_ops.linear(attn.q_proj, h).view(R, n, -1, self.head_dim)
        k = step_ops.linear(attn.k_proj, h).view(R, n, -1, self.head_dim)
        v = step_ops.linear(attn.v_proj, h).view(R, n, -1, self.head_dim).transpose(1, 2)
        if self.has_qk_norm:
            q, k = step_ops.rms_norm(attn.q_norm, q), step_ops.rms_norm(attn.k_norm, k)
        q = step_ops.rope(q, *rot).transpose(1, 2)  # [R, H, n, D]
        k = step_ops.rope(k, *rot).transpose(1, 2)  # [R, H_kv, n, D]
        if at is None:
            cache.write(i, k, v, slots)  # the slots; RoPE (cos, sin) carries the positions
        else:
            cache.write_run(i, k, v, at)
        k_all, v_all = cache.view(i, upto)
        out = cached_attention(q, k_all, v_all, visible, self.scale)  # [R, H, n, D]
        return step_ops.linear(attn.o_proj, out.transpose(1, 2).reshape(R, n, -1))

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], cache: KVCache, tap_layers: list[int] | None = None) -> TargetOutput:
        """Run ragged prompts (right-padded) into an empty cache; logits at each prompt's last token.

        Afterwards cache.lengths[r] == len(prompts[r]); taps cover all padded positions.
        """
        lens = torch.tensor([len(p) for p in prompts], device=self.device)
        if int(lens.min()) < 1:
            raise DFlashError("empty prompt: every prompt needs at least one token")
        ids = torch.zeros(len(prompts), int(lens.max()), dtype=torch.long, device=self.device)
        for r, p in enumerate(prompts):
            ids[r, : len(p)] = torch.tensor(p, dtype=torch.long)
        cache.crop(torch.zeros_like(lens))
        out = self.forward(ids, cache, tap_layers, logits_at=(lens - 1)[:, None])
        cache.crop(lens)
        return out


def _tree_mask(
    lengths: torch.Tensor, tree: tuple[torch.Tensor, torch.Tensor], n: int, upto: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE positions [R, n] and visibility [R, n, upto] of a token tree appended at slots lengths + 0..n-1:
    lengths [R]; tree = (depth [R, n], ancestors [R, n, n] bool, ancestors[r, j, j] True)."""
    depth, ancestors = tree
    R = lengths.shape[0]
    if tuple(depth.shape) != (R, n) or tuple(ancestors.shape) != (R, n, n):
        raise DFlashError(
            f"tree: depth {tuple(depth.shape)} / ancestors {tuple(ancestors.shape)} must be [{R}, {n}] / "
            f"[{R}, {n}, {n}] (rows x new tokens); build them with decoding/tree.py"
        )
    rel = torch.arange(upto, device=lengths.device)[None, :] - lengths[:, None]  # [R, upto] slot - first new slot
    among = ancestors.gather(2, rel.clamp(0, n - 1)[:, None, :].expand(-1, n, -1))  # [R, n, upto]
    visible = (rel < 0)[:, None, :] | (among & (rel < n)[:, None, :])
    return lengths[:, None] + depth, visible
