"""The DFlash drafter: KV injection of target context plus one-pass block drafting.

Boundary: this module owns the drafter's weights (fc, hidden_norm, decoder layers, final norm),
its checkpoint format (z-lab layout: config.json + model.safetensors without embedding or LM
head) and its two inference operations over a `KVCache` of context K/V:

  inject_context: fused context feature c = hidden_norm(fc(taps)); for every layer,
                  K = RoPE(k_norm(k_proj(c))), V = v_proj(c) are written at the tokens' own
                  positions. Context never passes through Q, O or the MLP.
  draft_block:    block [x0, MASK * (B-1)] at positions ctx_len..ctx_len+B-1; each layer's queries
                  come from the block only and attend, without a causal mask, to all context
                  K/V plus the block's own K/V. Output i (i >= 1) predicts block token i.
                  z-lab fields the reference honours: input_embedding_scale scales the block's
                  embeddings; a causal / sliding-window layer (is_causal, layer_types,
                  sliding_window) narrows its mask; output_multiplier and final_logit_softcapping
                  shape the draft logits (finish_logits). A family's extra weights
                  (dflash_trt/families; DFlash 2: a convolution around each layer's attention and
                  MLP, the candidate selector) are added by family.build and run here when present.

The embedding and LM head are the target's (frozen, shared, not saved). Training-time forward
(many blocks per sequence under one mask) lives in the training module and uses these layers.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from dflash_trt.atomic import atomic_dir
from dflash_trt.config import DrafterConfig
from dflash_trt.errors import CheckpointError, IncompatibleModelsError
from dflash_trt.modeling.cache import KVCache
from dflash_trt.modeling.cpu_pack import packed_matrix
from dflash_trt.modeling.drafter_layers import DrafterLayer, RMSNorm, RotaryEmbedding, cached_block_attention
from dflash_trt.modeling.fast_path import drafter_ops

WEIGHTS_NAME = "model.safetensors"


class DFlashDrafter(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.fc = nn.Linear(config.num_taps * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, config.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(config) for _ in range(config.num_hidden_layers))
        config.family.build(self)  # the family's extra weights (dflash_trt/families)
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)
        if config.draft_vocab_size is not None:  # token ids the head covers, sorted; saved with the weights
            self.register_buffer("draft_vocab", torch.arange(config.draft_vocab_size), persistent=True)
        else:
            self.draft_vocab = None
        self._target = None  # shared embedding / LM head; kept out of state_dict on purpose
        self._fast = None  # engine.fast_path.TritonDrafterOps when the Triton kernels are on

    # ---- wiring to the target -----------------------------------------------------------
    @property
    def family(self):
        """The drafter family module (dflash_trt/families): its propose step drives the engine."""
        return self.config.family

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def target_layer_ids(self) -> list[int]:
        return self.config.target_layer_ids

    def bind(self, target, cast: bool = True) -> DFlashDrafter:
        """Share the target's embedding and LM head after checking the two fit together.
        cast=True moves the drafter to the target's device and dtype (inference)."""
        check_compatible(self.config, target)
        object.__setattr__(self, "_target", target)  # a plain reference, not a submodule
        if cast:
            self.to(device=target.device, dtype=target.dtype)
        return self

    @property
    def target(self):
        if self._target is None:
            raise RuntimeError("drafter is not bound to a target: call drafter.bind(target) first")
        return self._target

    # ---- kernels switch ------------------------------------------------------------------
    def use_kernels(self, mode: str = "auto") -> str:
        """Run inject_context / draft_block on the Triton kernels ("triton"), the PyTorch
        reference ("torch") or whichever fits this device ("auto"); returns the one in use.
        Caches made before a switch belong to the old path (make new ones)."""
        self._fast = drafter_ops(self, mode)
        return self.kernels

    @property
    def kernels(self) -> str:
        return "torch" if self._fast is None else "triton"

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        c = self.config
        make = KVCache if self._fast is None else self._fast.new_cache  # the kernels want [L, R, ...] stacked
        # + 2 blocks of scratch: a block is written past the context, padded rows past that
        return make(
            c.num_hidden_layers,
            batch,
            c.num_key_value_heads,
            c.head_dim,
            max_len + 2 * c.block_size,
            self.fc.weight.dtype,
            self.fc.weight.device,
        )

    # ---- inference ----------------------------------------------------------------------
    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """Tapped target states [R, n, n_taps*d] -> context feature [R, n, d]."""
        return self.hidden_norm(self.fc(taps.to(self.fc.weight.dtype)))

    @torch.no_grad()
    def inject_context(self, taps: torch.Tensor, num_new: torch.Tensor, cache: KVCache) -> None:
        """KV injection of taps [R, n, n_taps*d] (row r: first num_new[r] [R] entries valid) at
        positions cache.lengths[r]..; advances cache.lengths by num_new."""
        n = taps.shape[1]
        if n == 0:
            return
        cache.check_room(n)
        positions = cache.lengths[:, None] + torch.arange(n, device=taps.device)
        ctx = self.fuse(taps)
        if self._fast is not None:  # kv_inject: every layer in one launch, valid tokens only
            self._fast.inject(ctx, positions, num_new, cache)
        else:
            cos, sin = self.rotary(positions, ctx.dtype)
            for i, layer in enumerate(self.layers):
                k, v = layer.self_attn.kv(ctx, cos, sin)
                cache.write(i, k, v, positions)  # padded entries land in scratch slots (see cache.py)
        cache.lengths = cache.lengths + num_new.to(cache.lengths)

    @torch.no_grad()
    def draft_block(self, block_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """block_ids [R, B] (column 0 = last verified token, rest mask) -> hidden [R, B, d] after
        the final norm. Context lengths are unchanged: block K/V are scratch."""
        R, B = block_ids.shape
        cache.check_room(B)
        positions = cache.lengths[:, None] + torch.arange(B, device=block_ids.device)  # [R, B]
        attend = (
            cached_block_attention(cache, positions, self.config)
            if self._fast is None
            else self._fast.block_attention(cache)
        )
        x = self.target.embed(block_ids)
        if self.config.input_embedding_scale != 1.0:  # in the embedding's dtype, as the reference scales it
            x = x * self.config.input_embedding_scale
        x = x.to(self.fc.weight.dtype)
        cos, sin = self.rotary(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            h = layer.input_layernorm(x)
            ac, mc = layer.attention_conv, layer.mlp_conv  # None but for DFlash 2
            if ac is not None:
                h, finish = ac.prepare(h)
            attn = layer.self_attn
            k, v = attn.kv(h, cos, sin)
            out = attend(i, attn.q(h, cos, sin), k, v)  # [R, H, B, D]
            h = attn.o_proj(out.transpose(1, 2).reshape(R, B, -1))
            x = x + (h if ac is None else ac.finish(h, finish))
            h = layer.post_attention_layernorm(x)
            if mc is not None:
                h, finish = mc.prepare(h)
            h = layer.ffn(h)
            x = x + (h if mc is None else mc.finish(h, finish))
        return self.norm(x)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., d] -> float32 logits over the draft vocabulary [..., Vd] (full vocab: Vd = V)
        through the target's shared LM head (only its draft-vocab rows when one is set)."""
        head, packed = self.target.lm_head, getattr(self, "packed", False)  # packed: inference on a CPU
        w = head.weight
        if self.draft_vocab is not None:
            # the head is frozen: gather its draft-vocab rows once per (weight, vocab) pair
            key = (w.data_ptr(), w.dtype, w.device, self.draft_vocab.data_ptr(), self.draft_vocab.device, packed)
            if getattr(self, "_head_rows", (None,))[0] != key:
                rows = w.detach().index_select(0, self.draft_vocab.to(w.device))
                if packed:
                    rows = packed_matrix(rows)
                object.__setattr__(self, "_head_rows", (key, rows))
            if packed:
                return self._head_rows[1](hidden.to(w.dtype)).float()
            w = self._head_rows[1]
        elif packed:
            return head(hidden.to(w.dtype)).float()
        return F.linear(hidden.to(w.dtype), w).float()

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """LM-head logits [..., Vd] -> draft logits: times output_multiplier, then softcapped to
        c * tanh(logits / c), as the reference's compute_logits (identity for a plain drafter)."""
        c = self.config
        if c.output_multiplier != 1.0:
            logits = logits * c.output_multiplier
        if c.final_logit_softcapping is not None:
            logits = torch.tanh(logits / c.final_logit_softcapping) * c.final_logit_softcapping
        return logits

    def draft_logits(self, block_ids: torch.Tensor, cache: KVCache, full_vocab: bool = True) -> torch.Tensor:
        """Logits [R, B-1, V] (float32) for block positions 1..B-1, via the target's LM head.
        With a draft vocabulary, tokens outside it get -inf (probability 0 under the draft), or
        with full_vocab=False the logits stay over the draft vocabulary [R, B-1, Vd] (column j is
        token draft_vocab[j]): greedy drafting needs no V-wide tensor (on a CPU, scattering,
        argmax and softmax over 152K columns took a quarter of a 1-layer drafter's step)."""
        logits = self.finish_logits(self.head_logits(self.draft_block(block_ids, cache)[:, 1:]))
        if self.draft_vocab is None or not full_vocab:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.draft_vocab, logits)

    # ---- checkpoint ---------------------------------------------------------------------
    def save_pretrained(self, folder: str | Path, portable: bool = False) -> None:
        """Write config.json + model.safetensors atomically (dflash_trt/atomic.py: temp dir, then rename).
        torch_dtype names the dtype the tensors are written in. portable=True writes a plain z-lab
        checkpoint without the draft-vocabulary extension (no draft_vocab tensor or draft_vocab_size):
        the reference loads it with no missing or unexpected keys, and drafts over the whole vocabulary."""
        state = {
            k: v.detach().contiguous().cpu()
            for k, v in self.state_dict().items()
            if not (portable and k == "draft_vocab")
        }
        state = self.config.family.save_keys(state)  # the family's published tensor names
        cfg = dataclasses.replace(self.config, dtype=str(self.fc.weight.dtype).removeprefix("torch."))
        with atomic_dir(folder) as tmp:
            cfg.save(tmp, portable)
            save_file(state, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(cls, folder: str | Path, target=None, dtype: torch.dtype | None = None) -> DFlashDrafter:
        folder = Path(folder)
        if not folder.is_dir():
            raise CheckpointError(
                f"drafter {folder}: not a folder; expected config.json + {WEIGHTS_NAME} "
                f"(train one with `dflash-trt train`)"
            )
        cfg = DrafterConfig.load(folder)
        wfile = folder / WEIGHTS_NAME
        if not wfile.is_file():
            raise CheckpointError(f"drafter {folder}: {WEIGHTS_NAME} not found")
        try:
            state = load_file(str(wfile))
        except Exception as e:  # safetensors raises its own error types for truncated files
            raise CheckpointError(f"drafter {wfile}: unreadable or corrupt ({e})") from None
        return cls.from_state_dict(cfg, state, str(wfile), target, dtype)

    @classmethod
    def from_state_dict(
        cls,
        cfg: DrafterConfig,
        state: dict[str, torch.Tensor],
        source: str,
        target=None,
        dtype: torch.dtype | None = None,
    ) -> DFlashDrafter:
        """A drafter of config `cfg` with the weights of `state` (from `source`, named in errors),
        after checking every tensor is there with the shape the config implies."""
        model = cls(cfg)
        state = cfg.family.load_keys(state)  # the family's published tensor names -> ours
        ours = model.state_dict()
        missing = sorted(set(ours) - set(state))
        if missing:
            raise CheckpointError(f"drafter {source}: missing tensors {missing[:4]}{'...' if len(missing) > 4 else ''}")
        unexpected = sorted(set(state) - set(ours))
        if unexpected:  # weights of something this drafter does not implement: refusing beats ignoring them
            raise CheckpointError(
                f"drafter {source}: unexpected tensors {unexpected[:4]}"
                f"{'...' if len(unexpected) > 4 else ''} (not part of a DFlash drafter of this "
                f"config.json; dflash-trt does not implement them)"
            )
        for k, t in ours.items():
            if tuple(state[k].shape) != tuple(t.shape):
                raise CheckpointError(
                    f"drafter {source}: tensor {k} has shape {tuple(state[k].shape)}, "
                    f"config.json implies {tuple(t.shape)}"
                )
        if model.draft_vocab is not None:
            dv = state["draft_vocab"]
            if (
                dv.dtype != torch.int64
                or bool((dv < 0).any() | (dv >= cfg.vocab_size).any())
                or (len(dv) > 1 and not bool((dv[1:] > dv[:-1]).all()))
            ):
                raise CheckpointError(
                    f"drafter {source}: draft_vocab must hold sorted, distinct int64 token ids "
                    f"in 0..{cfg.vocab_size - 1}"
                )
        model.load_state_dict({k: state[k] for k in ours}, strict=True)
        if dtype is not None:
            model.to(dtype)
        if target is not None:
            model.bind(target)
        return model.eval()


def fit_problems(cfg: DrafterConfig, hidden_size: int, vocab_size: int, num_layers: int) -> list[str]:
    """What keeps a drafter (its config) from fitting a target with these sizes: the one home of the fit
    rule, read by bind() on loaded models and by the build's check stage on configs alone."""
    problems = []
    if cfg.hidden_size != hidden_size:
        problems.append(f"hidden_size {cfg.hidden_size} != target hidden_size {hidden_size}")
    if cfg.vocab_size != vocab_size:
        problems.append(f"vocab_size {cfg.vocab_size} != target vocab size {vocab_size}")
    if cfg.num_target_layers != num_layers:
        problems.append(f"num_target_layers {cfg.num_target_layers} != target's {num_layers} layers")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < num_layers]
    if bad:
        problems.append(f"dflash_config.target_layer_ids {bad} outside the target's layers 0..{num_layers - 1}")
    if not 0 <= cfg.mask_token_id < vocab_size:
        problems.append(f"dflash_config.mask_token_id {cfg.mask_token_id} outside the target vocabulary")
    return problems


def check_fit(cfg: DrafterConfig, hidden_size: int, vocab_size: int, num_layers: int) -> None:
    """Raise IncompatibleModelsError naming the fields when drafter and target do not fit."""
    problems = fit_problems(cfg, hidden_size, vocab_size, num_layers)
    if problems:
        raise IncompatibleModelsError(
            "drafter does not fit the target: "
            + "; ".join(problems)
            + " (this drafter was made for another target: train one for it with `dflash-trt train`)"
        )


def check_compatible(cfg: DrafterConfig, target) -> None:
    """check_fit against a loaded TargetModel."""
    check_fit(cfg, target.config.hidden_size, target.vocab_size, target.num_layers)
