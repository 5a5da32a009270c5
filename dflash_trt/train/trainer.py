"""Drafter training loop: TrainConfig (YAML + CLI overrides), features online or offline,
AdamW with cosine schedule, resumable atomic checkpoints.

Boundary: orchestration only; the objective is in objective.py (family_loss: every drafter family;
dpace_loss: loss=dpace), data formats in data.py, checkpoint save / resume / warm start in
checkpoint.py, the target forward that taps features and the offline feature store in features.py,
multi-process (torchrun) plumbing in distributed.py.
Determinism: the epoch order and every batch's anchors derive from (seed, index), never from a
running RNG, so a run resumed from a checkpoint at step k reaches the same weights as one that
never stopped.

Output folder:
  OUT/checkpoint/  drafter (z-lab layout) + trainer_state.pt, replaced atomically every save_every steps
  OUT/drafter/     the final drafter (z-lab layout), loadable by DFlashDrafter.from_pretrained
  OUT/metrics.jsonl  train metrics every log_every steps; held-out (val_data) metrics at every save
"""

from __future__ import annotations

import dataclasses
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from dflash_trt import families
from dflash_trt.api import load_target, native_bf16, resolve_device
from dflash_trt.config import DrafterConfig, check_block_size
from dflash_trt.errors import ConfigError
from dflash_trt.modeling.drafter import DFlashDrafter
from dflash_trt.train import distributed
from dflash_trt.train.checkpoint import (
    check_resume,
    freeze_except,
    init_config,
    resume,
    save_checkpoint,
    trainer_state,
    warm_start,
)
from dflash_trt.train.data import data_folders, training_sequences
from dflash_trt.train.distill import feature_layers, soft_labels, split_features
from dflash_trt.train.features import FeatureStore, offline_features, taps_scale, target_block_logits, target_taps
from dflash_trt.train.objective import (
    cosine_lr,
    default_gamma,
    dpace_loss,
    family_loss,
    make_blocks,
    make_optimizer,
    next_tokens,
    optimizer_step,
    sample_anchors,
)
from dflash_trt.train.precondition import use_tap_scaling
from dflash_trt.train.validate import MetricsLog, Validator

FAMILY_NAMES = {m.NAME: m for m in families.FAMILIES.values()}


@dataclass
class TrainConfig:
    target: str = ""  # target model: known name or HF folder
    data: str = ""  # folder(s) of data-*.jsonl shards (data generate / data score), comma-separated to mix
    out: str = ""  # output folder (checkpoint/ and drafter/)
    num_layers: int = 1  # drafter decoder layers
    block_size: int = 16
    target_layer_ids: list[int] | None = None  # default: 5 evenly spread target layers
    anchors_per_seq: int = 16  # blocks trained per sequence, resampled each epoch
    gamma: float | None = None  # loss decay; default 7 for B=16, 5 for B=10, 4 for B=8
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    epochs: int = 1
    max_steps: int | None = None  # stop after this many optimizer steps (schedule still spans all epochs)
    batch_size: int = 4  # sequences per micro-batch (under torchrun: the global one, split among the ranks)
    grad_accum: int = 1
    max_seq_len: int = 1024  # longer sequences are truncated
    bf16: bool | None = (
        None  # bf16 autocast, fp32 master weights; default: where bf16 GEMMs are native (GPU, AVX512-BF16/AMX CPU)
    )
    features: str = "online"  # online: target forward per step; offline: precomputed once to disk
    features_dir: str | None = None  # offline features location (default OUT/features)
    draft_vocab: int = 0  # 0: full vocabulary; N: the head covers the N most frequent response tokens (faster)
    save_every: int = 200
    log_every: int = 10
    seed: int = 0
    dtype: str = "auto"  # target weights dtype (auto: bf16 where bf16 GEMMs are native, else fp32)
    device: str = "auto"  # where target and drafter run: auto (a CUDA GPU if any, else CPU) | cpu | cuda | cuda:N
    val_data: str | None = None  # held-out data folder (data generate --validation): metrics at every save
    tap_scaling: bool = True  # train fc on taps / their per-dim RMS (target layers differ 10-100x); folded on save
    kd_weight: float = 0.0  # soft labels: loss = (1-a)*CE(label) + a*CE(target dist); > 0 also stores its last layer
    family: str = "dflash"  # drafter family: dflash | dflash2 | dspark | domino (its own loss: family_loss)
    family_fields: dict | None = None  # the family's own config fields (YAML mapping; CLI: JSON), e.g. markov_rank
    init_from: str | None = None  # warm start: a DFlash drafter folder; backbone copied, family heads from init_heads
    freeze_backbone: bool = False  # with init_from: train only the family's head parameters
    loss: str = "dflash"  # plain DFlash objective: dflash (CE weighted exp(-(k-1)/gamma)) | dpace (D-PACE weights)
    dpace_alpha: float = 0.5  # loss=dpace: smoothing of the acceptance prefix product, in [0, 1]

    def __post_init__(self):
        check_block_size(self.block_size)
        if self.max_seq_len <= self.block_size:
            raise ConfigError(f"block_size={self.block_size} must be smaller than max_seq_len={self.max_seq_len}")
        if self.features not in ("online", "offline"):
            raise ConfigError(f"features={self.features!r}: choose 'online' or 'offline'")
        for name in ("num_layers", "anchors_per_seq", "epochs", "batch_size", "grad_accum", "save_every", "log_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.draft_vocab < 0:
            raise ConfigError(f"draft_vocab={self.draft_vocab}: must be 0 (full vocabulary) or a token count")
        if self.lr <= 0:
            raise ConfigError(f"lr={self.lr}: must be > 0")
        resolve_device(self.device)  # a GPU asked for where there is none fails here, naming the field
        if not 0.0 <= self.kd_weight <= 1.0:
            raise ConfigError(
                f"kd_weight={self.kd_weight}: must be in [0, 1] (0: hard labels only, 1: soft labels only)"
            )
        self._check_family()
        world = distributed.world_size()
        if self.batch_size % world:
            raise ConfigError(f"batch_size={self.batch_size}: must divide evenly among WORLD_SIZE={world} ranks")

    def _check_family(self) -> None:
        if self.family not in FAMILY_NAMES:
            raise ConfigError(f"family={self.family!r}: choose one of {', '.join(FAMILY_NAMES)}")
        mod, fields = FAMILY_NAMES[self.family], self.family_fields or {}
        if not isinstance(fields, dict):
            raise ConfigError(f"family_fields={fields!r}: must be a mapping of field: value")
        for k, v in fields.items():
            if k not in mod.CONFIG_KEYS:
                owner = families.owner_of(k, v)
                whose = f"a {owner.LABEL} field (family: {owner.NAME})" if owner else "no drafter family's field"
                raise ConfigError(
                    f"family_fields.{k}: {whose}, not a {mod.LABEL} one ({', '.join(mod.CONFIG_KEYS) or 'none'})"
                )
        missing = [k for k in mod.CONFIG_KEYS if k not in mod.DEFAULTS and k not in fields]
        if missing:
            raise ConfigError(f"family_fields: a {mod.LABEL} drafter needs {', '.join(missing)}")
        plain = self.family == "dflash"
        if self.loss not in ("dflash", "dpace"):
            raise ConfigError(f"loss={self.loss!r}: choose 'dflash' or 'dpace'")
        if self.loss == "dpace" and not plain:
            raise ConfigError(f"loss=dpace: weights plain DFlash's CE; family={self.family} trains its own terms")
        if not 0.0 <= self.dpace_alpha <= 1.0:
            raise ConfigError(f"dpace_alpha={self.dpace_alpha}: must be in [0, 1]")
        if self.draft_vocab and (self.init_from or not plain):
            why = "init_from keeps the backbone's" if plain else f"family={self.family} trains on the full vocabulary"
            raise ConfigError(f"draft_vocab={self.draft_vocab}: leave 0 ({why})")
        if self.kd_weight and not plain:
            raise ConfigError(f"kd_weight={self.kd_weight}: soft labels train plain DFlash only, not {mod.LABEL}")
        if self.freeze_backbone and (not self.init_from or plain):
            raise ConfigError("freeze_backbone: needs init_from and a family with heads of its own (not dflash)")
        mismatch = getattr(mod, "backbone_mismatch", None)  # the head drafts the token after the backbone's
        why = mismatch({**mod.DEFAULTS, **fields}) if self.init_from and mismatch else None
        if why:
            raise ConfigError(
                f"init_from={self.init_from}: a DFlash backbone's block position k predicts token a+k; {why}"
            )


def frequent_tokens(seqs: list[dict], n: int) -> torch.Tensor:
    """Sorted ids of the n most frequent label tokens, i.e. response tokens or, for teacher-forced
    text, the target's greedy predictions (ties: lower id first) -> [<= n]."""
    counts: dict[int, int] = {}
    for s in seqs:
        labels = s["target_next"][s["prompt_len"] - 1 :] if "target_next" in s else s["input_ids"][s["prompt_len"] :]
        for t in labels:
            counts[t] = counts.get(t, 0) + 1
    top = sorted(counts, key=lambda t: (-counts[t], t))[:n]
    return torch.tensor(sorted(top), dtype=torch.long)


def _drafter_config(cfg: TrainConfig, target, seqs: list[dict]) -> tuple[DrafterConfig, torch.Tensor | None]:
    """The drafter's shape and family for this target, and its draft vocabulary (None: the target's
    whole one, or init_from's)."""
    dcfg = DrafterConfig.for_target(
        target.config, num_layers=cfg.num_layers, block_size=cfg.block_size, target_layer_ids=cfg.target_layer_ids
    )
    mod = FAMILY_NAMES[cfg.family]
    if mod.ARCHITECTURE != dcfg.architectures[0]:  # the family's fields are checked against this shape here
        dcfg = dataclasses.replace(dcfg, architectures=[mod.ARCHITECTURE], family_fields=dict(cfg.family_fields or {}))
    vocab = None
    if cfg.init_from:
        dcfg.draft_vocab_size = init_config(cfg.init_from, dcfg).draft_vocab_size
        if dcfg.draft_vocab_size is not None and cfg.family != "dflash":
            raise ConfigError(f"init_from={cfg.init_from}: has a draft vocabulary; {mod.LABEL} trains on the full one")
    elif cfg.draft_vocab:
        vocab = frequent_tokens(seqs, min(cfg.draft_vocab, target.vocab_size))
        dcfg.draft_vocab_size = len(vocab)
    return dcfg, vocab


def _micro_batch_indices(num_seqs: int, batch_size: int, seed: int, i: int, per_epoch: int) -> list[int]:
    """The sequences of global micro-batch i: its epoch's order derives from (seed, epoch) alone."""
    epoch, pos = divmod(i, per_epoch)
    order = torch.randperm(num_seqs, generator=torch.Generator().manual_seed(seed * 7919 + epoch))
    return order[pos * batch_size : (pos + 1) * batch_size].tolist()


def _micro_batch_loss(
    cfg: TrainConfig,
    dcfg: DrafterConfig,
    target,
    drafter: DFlashDrafter,
    seqs: list[dict],
    gidx: list[int],
    share: slice,
    i: int,
    store: FeatureStore | None,
    layers: list[int],
    gamma: float,
    autocast,
):
    """The loss of this rank's share of global micro-batch i (sequences gidx), before backward; its
    token count; and the factor that makes it its part of the global batch's loss (distributed.py).
    Anchors come from (seed, i) for the whole global batch, so no sample depends on the world size."""
    gbatch = [seqs[j] for j in gidx]
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + i)  # anchors from (seed, index): resumable
    g_anchors, g_valid = sample_anchors(
        [len(s["input_ids"]) for s in gbatch],
        [s["prompt_len"] for s in gbatch],
        cfg.anchors_per_seq,
        cfg.block_size,
        gen,
    )
    idx, batch, anchors, valid = gidx[share], gbatch[share], g_anchors[share], g_valid[share]
    if not batch:  # a short last batch of an epoch: nothing for this rank
        return None, 0, 0.0
    lens = [len(s["input_ids"]) for s in batch]
    S = max(lens)
    ids = torch.zeros(len(batch), S, dtype=torch.long)
    for r, s in enumerate(batch):
        ids[r, : lens[r]] = torch.tensor(s["input_ids"])
    ids = ids.to(target.device)
    feats = (
        store.get(idx, S).to(target.device) if store else target_taps(target, [s["input_ids"] for s in batch], layers)
    )
    taps, teacher = split_features(feats, dcfg.num_taps, dcfg.hidden_size)
    blocks = make_blocks(
        ids,
        anchors.to(ids.device),
        valid.to(ids.device),
        cfg.block_size,
        dcfg.mask_token_id,
        next_tokens(batch, S, ids.device),
    )
    if cfg.loss == "dpace":  # normalised by the number of sequences
        with autocast:
            res = dpace_loss(drafter, taps, blocks, gamma, cfg.dpace_alpha)
        return res, sum(lens), distributed.loss_scale(len(batch), len(gbatch))
    soft = soft_labels(drafter, teacher, blocks.positions) if teacher is not None and cfg.kd_weight else None
    # a family whose terms match the target's distribution at each block position (DSpark's L1, confidence)
    teacher = FAMILY_NAMES[cfg.family].TEACHER is not None
    logits = target_block_logits(target, ids, blocks.positions) if teacher else None
    with autocast:
        res = family_loss(drafter, taps, blocks, gamma, soft, cfg.kd_weight, teacher_logits=logits)
    return res, sum(lens), distributed.loss_scale(float(valid.sum()), float(g_valid.sum()))


def _log_step(bar, metrics: MetricsLog, step: int, res, loss: torch.Tensor, lr: float, tok_s: float) -> None:
    """loss: the last micro-batch's global loss (all ranks); accuracy / tau_est: this rank's share's."""
    acc = res.accuracy.tolist()
    bar.set_postfix(
        loss=f"{loss.item():.3f}",
        acc1=f"{acc[0]:.2f}",
        tau_est=f"{1 + res.accepted.item():.2f}",
        tok_s=f"{tok_s:.0f}",
        lr=f"{lr:.1e}",
    )
    metrics.write(
        {
            "step": step,
            "loss": loss.item(),
            "acc": [round(a, 4) for a in acc],
            "tau_est": 1 + res.accepted.item(),
            "lr": lr,
            "tok_s": tok_s,
        }
    )


def _log_validation(bar, metrics: MetricsLog, step: int, v: dict) -> None:
    metrics.write({"step": step, **v})
    bar.write(
        f"step {step}: held-out loss {v['val_loss']:.3f}, tau_est {v['val_tau_est']:.2f}, "
        f"acc@1 {v['val_acc'][0]:.2f} ({v['val_blocks']} blocks)"
    )


def _make_drafter(cfg: TrainConfig, target, dcfg, vocab, state, seqs, store) -> DFlashDrafter:
    """The drafter to train, with its tap scale, draft vocabulary, warm start and frozen backbone."""
    torch.manual_seed(cfg.seed)
    drafter = DFlashDrafter(dcfg).bind(target, cast=False).to(device=target.device, dtype=torch.float32).train()
    if vocab is not None and state is None:
        drafter.draft_vocab.copy_(vocab)
    if cfg.tap_scaling:  # the scale is kept in the trainer state: a resumed run uses the same one
        scale = state["tap_scale"] if state is not None else taps_scale(target, seqs, dcfg.target_layer_ids, store)
        use_tap_scaling(drafter, scale)
    if state is None and cfg.init_from:
        heads = warm_start(drafter, cfg.init_from, cfg.freeze_backbone)
        if distributed.rank() == 0:
            print(f"init_from {cfg.init_from}: backbone copied; {len(heads)} head tensors from init_heads")
    elif state is not None and cfg.freeze_backbone:
        freeze_except(drafter, state["trained"])
    terms = FAMILY_NAMES[cfg.family].TEACHER
    if terms is not None and distributed.rank() == 0:
        print(f"{cfg.family}: {terms} against the target's logits (computed each batch)")
    return drafter


def train(cfg: TrainConfig, target=None, progress: bool = True) -> Path:
    """Train a drafter for cfg.target on cfg.data; returns OUT/drafter. Resumes from OUT/checkpoint.
    Under torchrun (WORLD_SIZE > 1) each rank trains its share of every batch (distributed.py)."""
    folders = data_folders(cfg)
    out = Path(cfg.out)
    if target is None:
        if not cfg.target:
            raise ConfigError("target: give a target model name or folder")
        device = distributed.local_device(cfg.device)
        target, _ = load_target(cfg.target, cfg.dtype, progress, for_training=True, device=device)
    world = distributed.world_size() if distributed.setup(target.device) else 1
    rank = distributed.rank() if world > 1 else 0
    seqs = training_sequences(cfg, folders)
    dcfg, vocab = _drafter_config(cfg, target, seqs)
    ckpt = out / "checkpoint"
    data_fp = FeatureStore.fingerprint([s["input_ids"] for s in seqs], [cfg.seed, cfg.batch_size, cfg.grad_accum])
    state = None
    if (ckpt / "trainer_state.pt").is_file():
        state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
        dcfg.draft_vocab_size = check_resume(ckpt, state, dcfg, data_fp, cfg.tap_scaling)  # its head is kept
    store = None
    layers = feature_layers(dcfg.target_layer_ids, target.config.num_hidden_layers, cfg.kd_weight > 0)
    if cfg.features == "offline":
        if rank == 0:  # one rank writes the store; the others open it
            layers, store = offline_features(cfg, target, dcfg, seqs, out, layers)
        distributed.barrier()
        if rank != 0:
            layers, store = offline_features(cfg, target, dcfg, seqs, out, layers)
    drafter = _make_drafter(cfg, target, dcfg, vocab, state, seqs, store)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = make_optimizer(params, cfg.lr, cfg.weight_decay)
    gamma = cfg.gamma or default_gamma(cfg.block_size)
    per_epoch = math.ceil(len(seqs) / cfg.batch_size)
    total = max(1, cfg.epochs * per_epoch // cfg.grad_accum)
    stop_at = min(total, cfg.max_steps or total)
    step = resume(ckpt, state, drafter, opt, cfg.tap_scaling)
    validator = None
    if cfg.val_data and rank == 0:
        validator = Validator(
            target, cfg.val_data, dcfg.target_layer_ids, cfg.block_size, dcfg.mask_token_id, gamma, cfg.max_seq_len
        )
    metrics = MetricsLog(out / "metrics.jsonl", step) if rank == 0 else None
    use_bf16 = native_bf16(target.device) if cfg.bf16 is None else cfg.bf16
    autocast = torch.autocast(target.device.type, dtype=torch.bfloat16) if use_bf16 else nullcontext()
    bar = tqdm(total=stop_at, initial=step, desc="training drafter", disable=not progress or rank != 0)
    t0, seen, res = time.perf_counter(), 0, None
    while step < stop_at:
        lr = cosine_lr(step, total, cfg.lr, cfg.warmup_ratio)
        opt.zero_grad(set_to_none=True)
        part = torch.zeros((), device=target.device)  # this rank's part of the last micro-batch's global loss
        for m in range(cfg.grad_accum):
            i = step * cfg.grad_accum + m  # global micro-batch index
            gidx = _micro_batch_indices(len(seqs), cfg.batch_size, cfg.seed, i, per_epoch)
            share = distributed.share(gidx, rank, world)
            out_i, tokens, scale = _micro_batch_loss(
                cfg, dcfg, target, drafter, seqs, gidx, share, i, store, layers, gamma, autocast
            )
            if out_i is not None:
                res = out_i
                loss = res.loss * scale if scale != 1.0 else res.loss
                (loss / cfg.grad_accum).backward()
                part = loss.detach().float()
            seen += tokens
        distributed.all_reduce_grads(params)
        optimizer_step(opt, params, lr, cfg.grad_clip)
        step += 1
        bar.update(1)
        if step % cfg.log_every == 0 or step == stop_at:
            global_loss = distributed.global_mean(part)  # every rank takes part
            if metrics is not None and res is not None:
                _log_step(bar, metrics, step, res, global_loss, lr, seen * world / (time.perf_counter() - t0))
        if step % cfg.save_every == 0 or step == stop_at:
            if validator is not None:
                _log_validation(bar, metrics, step, validator(drafter))
            if rank == 0:
                save_checkpoint(ckpt, drafter, trainer_state(cfg, drafter, opt, step, data_fp))
    bar.close()
    final = out / "drafter"
    if rank == 0:
        DFlashDrafter.from_pretrained(ckpt).save_pretrained(final)
    distributed.barrier()
    return final
