"""A target too large for one device, split into pipeline stages across torchrun ranks.

Boundary: training's target work only (tapped hidden states for features and online training);
decoding and serving keep the whole-target TargetModel. Rank r of W holds decoder layers
stage_bounds(L, W)[r] plus the embedding, final norm and LM head (the drafter shares the last two
and the embedding with the target, so every rank needs them: 2 x V x d, 4.2 GB for a 70B in bf16),
loaded straight from the checkpoint's safetensors (only those tensors are read: a 70B rank reads
~1/W of the weights). `StageTarget.taps` is collective: every rank calls it with its own
sequences (its share of a batch, as the trainer already splits them), each rank's share flows
through the stages in turn (stage s runs share c while stage s+1 runs share c-1: a pipeline whose
W shares keep the W stages busy in steady state), and each rank gets back its own share's taps.
So the drafter is trained with DDP exactly as with a whole target (train/distributed.py): the
ranks are at once the target's stages and the drafter's data-parallel replicas.

Why pipeline stages across ranks rather than accelerate's device map in one process: a device map
runs the layers one device after the other for one process's batch (one GPU busy at a time), and
one process driving eight GPUs cannot also be eight DDP ranks; stages across ranks keep the
trainer's one-rank-per-GPU layout and overlap the stages.

Numerics: every stage runs TargetModel's own layer code (its _attention over a KVCache, the HF
norms and MLPs) on the same padded share, so a share's taps equal a single process's
target_taps of that share up to the reduction order of the kernels (tests/test_split_target.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from dflash_trt.api import parse_dtype, resolve_device, resolve_target_dir
from dflash_trt.errors import CheckpointError, DFlashError
from dflash_trt.modeling.cache import KVCache
from dflash_trt.modeling.target import TargetModel
from dflash_trt.train import distributed


def stage_bounds(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """Contiguous decoder-layer ranges [lo, hi), one per stage, sizes differing by at most one."""
    if not 1 <= stages <= num_layers:
        raise DFlashError(f"a target of {num_layers} layers cannot be split into {stages} stages (1..{num_layers})")
    return [(s * num_layers // stages, (s + 1) * num_layers // stages) for s in range(stages)]


def _checkpoint_tensors(path: Path, wanted) -> dict[str, torch.Tensor]:
    """The tensors of the model folder's safetensors whose name passes wanted(name), read one by one."""
    from safetensors import safe_open  # deferred: with transformers, as TargetModel.from_pretrained

    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"{path}: a split target needs safetensors weights (model.safetensors[.index.json])")
    out = {}
    for name in files:
        with safe_open(str(path / name), framework="pt") as f:
            for key in f.keys():
                if wanted(key):
                    out[key] = f.get_tensor(key)
    return out


class StageTarget:
    """Rank `rank`'s stage of a target split over `world` ranks (module docstring). Offers what
    training reads of a TargetModel: config, device, dtype, num_layers, vocab_size, embed,
    lm_head, norm, logits; `forward` is not offered (the layers are spread over the ranks)."""

    def __init__(self, inner: TargetModel, rank: int, world: int, device: torch.device):
        self.inner, self.rank, self.world, self.device = inner, rank, world, device
        self.lo, self.hi = stage_bounds(inner.num_layers, world)[rank]
        self.config, self.stop_ids = inner.config, inner.stop_ids

    @classmethod
    def load(cls, path: str | Path, dtype: torch.dtype, device: torch.device, rank: int, world: int) -> StageTarget:
        """Build the model on the meta device, then materialise and load only this stage's layers and
        the shared embedding / norm / LM head."""
        from transformers import AutoConfig, AutoModelForCausalLM  # deferred: ~0.6 s import

        path = Path(path)
        cfg = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        lo, hi = stage_bounds(cfg.num_hidden_layers, world)[rank]
        mine = [hf.model.embed_tokens, hf.model.norm, hf.lm_head, *hf.model.layers[lo:hi]]
        for m in mine:
            m.to_empty(device=device)
        prefixes = ["model.embed_tokens.", "model.norm.", "lm_head."] + [f"model.layers.{i}." for i in range(lo, hi)]
        state = _checkpoint_tensors(path, lambda k: any(k.startswith(p) for p in prefixes))
        if "lm_head.weight" not in state:  # tied embeddings
            state["lm_head.weight"] = state.get("model.embed_tokens.weight")
        missing = [n for n, _ in hf.named_parameters() if any(n.startswith(p) for p in prefixes) and n not in state]
        if missing:
            raise CheckpointError(f"{path}: the checkpoint lacks {missing[:3]} (stage {rank} of {world})")
        with torch.no_grad():
            for n, p in hf.named_parameters():
                if n in state:
                    p.copy_(state[n].to(dtype))
        # the rotary tables are computed, not stored: made again on the device (meta has no values)
        with torch.device(device):
            hf.model.rotary_emb = type(hf.model.rotary_emb)(config=cfg)
        return cls(TargetModel(hf, path), rank, world, device)

    # ---- what training reads of a target ----------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.inner.dtype

    @property
    def num_layers(self) -> int:
        return self.inner.num_layers

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    @property
    def lm_head(self):
        return self.inner.lm_head

    @property
    def norm(self):
        return self.inner.norm

    @property
    def embed_tokens(self):
        return self.inner.embed_tokens

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner.embed(ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.inner.logits(hidden)

    def forward(self, *a, **kw):
        raise DFlashError(
            "a split target runs no whole forward (decoding, the target's logits at block positions); "
            "it gives tapped features only (StageTarget.taps)"
        )

    # ---- the pipeline -----------------------------------------------------------------------
    def _run_layers(self, x: torch.Tensor, want: set[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """This stage's layers on x [n, S, d] (positions 0..S-1, causal) -> (x, {layer: tap})."""
        t = self.inner
        n, S, _ = x.shape
        cache = KVCache(self.hi - self.lo, n, t.num_kv_heads, t.head_dim, S, t.dtype, self.device)
        slots = cache.lengths[:, None] + torch.arange(S, device=self.device)
        visible = torch.arange(S, device=self.device)[None, None, :] <= slots[:, :, None]
        rot = t.rotation(x, slots)
        taps = {}
        for i in range(self.lo, self.hi):
            layer = t.layers[i]
            x = x + t._attention(layer, layer.input_layernorm(x), i - self.lo, cache, slots, S, visible, rot, None)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if i in want:
                taps[i] = t.norm(x) if i == t.num_layers - 1 else x
        return x, taps

    @torch.no_grad()
    def taps(self, seqs: list[list[int]], tap_layers: list[int]) -> torch.Tensor:
        """Collective: this rank's sequences -> their tapped states [n, S, taps*d] (as target_taps)."""
        shares: list = [None] * self.world
        dist.all_gather_object(shares, [list(map(int, s)) for s in seqs])
        want, d = set(tap_layers), self.config.hidden_size
        owner = {i: s for s, (lo, hi) in enumerate(stage_bounds(self.num_layers, self.world)) for i in range(lo, hi)}
        mine: dict[int, dict[int, torch.Tensor]] = {}  # share -> this stage's taps of it
        for c, share in enumerate(shares):  # share c enters stage 0 after share c-1: the stages overlap
            if not share:
                continue
            n, S = len(share), max(map(len, share))
            if self.rank == 0:
                ids = torch.zeros(n, S, dtype=torch.long)
                for r, s in enumerate(share):
                    ids[r, : len(s)] = torch.tensor(s)
                x = self.inner.embed(ids.to(self.device))
            else:
                x = torch.empty(n, S, d, dtype=self.dtype, device=self.device)
                dist.recv(x, self.rank - 1)
            x, mine[c] = self._run_layers(x, want)
            if self.rank < self.world - 1:
                dist.send(x.contiguous(), self.rank + 1)
        # every share's taps to its rank: stage s sends the layers it holds, rank c receives them all
        works, got = [], {}
        for c, share in enumerate(shares):
            if not share:
                continue
            n, S = len(share), max(map(len, share))
            for i in sorted(want):
                s = owner[i]
                if s == self.rank and c == self.rank:
                    got[i] = mine[c][i]
                elif s == self.rank:
                    works.append(dist.isend(mine[c][i].contiguous(), c))
                elif c == self.rank:
                    got[i] = torch.empty(n, S, d, dtype=self.dtype, device=self.device)
                    works.append(dist.irecv(got[i], s))
        for w in works:
            w.wait()
        if not seqs:
            return torch.empty(0, 0, len(tap_layers) * d, dtype=self.dtype, device=self.device)
        return torch.cat([got[i] for i in tap_layers], dim=-1)


def load_split_target(name_or_dir: str, dtype: str, device: str) -> StageTarget:
    """This torchrun rank's stage (the process group is joined here: gloo on CPU, nccl on CUDA)."""
    world = distributed.world_size()
    if world < 2:
        raise DFlashError("--split-target: run under torchrun with 2 or more processes (one stage each)")
    dev = resolve_device(distributed.local_device(device))
    distributed.setup(dev)
    return StageTarget.load(
        resolve_target_dir(name_or_dir), parse_dtype(dtype, True, dev), dev, distributed.rank(), world
    )
