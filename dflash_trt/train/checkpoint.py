"""Training checkpoints: what one holds, writing it as one unit, and resuming from it.

Boundary: a checkpoint folder is the drafter's files (z-lab layout) plus trainer_state.pt (step,
optimizer moments, the run's config, the data fingerprint, the tap scale); `save_checkpoint` replaces
the folder atomically (dflash_trt/atomic.py). `check_resume` refuses a checkpoint of another drafter
shape, family or tap scaling with the fix; `resume` loads weights and optimizer state. `warm_start`
(init_from) copies a DFlash backbone into a family drafter, its heads from the family's init_heads,
optionally training only those (freeze_backbone). The state holds the global step only, never a
rank's: a run resumes at any world size. When to save is the trainer's decision (train/trainer.py);
under torchrun only rank 0 saves.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch

from dflash_trt.atomic import atomic_dir
from dflash_trt.config import DrafterConfig
from dflash_trt.errors import CheckpointError, ConfigError
from dflash_trt.modeling.drafter import DFlashDrafter

SHAPE_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "block_size",
    "target_layer_ids",
    "mask_token_id",
    "draft_vocab_size",
)


def check_resume(ckpt: Path, state: dict, dcfg: DrafterConfig, data_fp: str, tap_scaling: bool) -> int | None:
    """The checkpoint's draft vocabulary size, once resuming is known to be possible. A checkpoint of
    another drafter shape or tap scaling is refused with the fix (its weights and optimizer moments
    live in another space); one trained on other data or batching continues, but says so (the run
    is then no longer bit-reproducible)."""
    if state["config"].get("tap_scaling", False) != tap_scaling:
        raise ConfigError(
            f"tap_scaling={tap_scaling}: the checkpoint in {ckpt} was trained with "
            f"tap_scaling={not tap_scaling}; keep that setting to resume, or train into a new --out"
        )
    old = DrafterConfig.load(ckpt)
    differ = [
        f"{f}: checkpoint {getattr(old, f)} vs now {getattr(dcfg, f)}"
        for f in SHAPE_FIELDS
        if f != "draft_vocab_size" and getattr(old, f) != getattr(dcfg, f)
    ]
    for f in ("architectures", "family_fields"):  # another family's heads: another model
        if getattr(old, f) != getattr(dcfg, f):
            differ.append(f"{f}: checkpoint {getattr(old, f)} vs now {getattr(dcfg, f)}")
    if (old.draft_vocab_size is None) != (dcfg.draft_vocab_size is None):
        differ.append(f"draft_vocab_size: checkpoint {old.draft_vocab_size} vs now {dcfg.draft_vocab_size}")
    if differ:
        raise ConfigError(
            f"{ckpt} holds a drafter of another shape ({'; '.join(differ)}); "
            f"train into a new --out, or delete {ckpt} to start over"
        )
    if state.get("data_fingerprint") not in (None, data_fp):
        print(
            f"{ckpt}: the data (or seed / batch size) changed since this checkpoint; continuing from step "
            f"{state['step']} on the current data (delete the checkpoint to start over)"
        )
    return old.draft_vocab_size


def save_checkpoint(folder: Path, drafter: DFlashDrafter, state: dict) -> None:
    """The drafter's files and trainer_state.pt, replacing `folder` as one unit (dflash_trt/atomic.py)."""
    with atomic_dir(folder, tag="ckpt") as tmp:
        drafter.save_pretrained(tmp / "d")
        for f in (tmp / "d").iterdir():
            f.rename(tmp / f.name)
        (tmp / "d").rmdir()
        torch.save(state, tmp / "trainer_state.pt")


def init_config(folder: str, dcfg: DrafterConfig) -> DrafterConfig:
    """init_from: the backbone drafter's config, refused (one line naming the field) when its shape is
    not this run's; the run then takes its draft vocabulary size."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConfigError(f"init_from={folder}: no drafter there (config.json missing)")
    try:
        old = DrafterConfig.load(folder)
    except CheckpointError as e:  # e.g. config.json not valid JSON
        raise ConfigError(f"init_from={folder}: {e}") from None
    for f in SHAPE_FIELDS[:-1]:
        if getattr(old, f) != getattr(dcfg, f):
            raise ConfigError(f"init_from={folder}: {f} is {getattr(old, f)} there but {getattr(dcfg, f)} in this run")
    return old


def warm_start(drafter: DFlashDrafter, folder: str, freeze: bool) -> list[str]:
    """Copy a DFlash backbone's weights (init_from) into a family drafter, start the family's heads
    from its init_heads (identity / zero output), and with freeze train only those heads. Call after
    use_tap_scaling (ScaledFC takes the saved raw fc weight back). -> the head parameters' names."""
    src = DFlashDrafter.from_pretrained(folder).state_dict()
    missing, unexpected = drafter.load_state_dict(src, strict=False)
    if unexpected:
        raise ConfigError(f"init_from={folder}: holds weights this drafter lacks ({', '.join(unexpected[:3])})")
    init_heads = getattr(drafter.config.family, "init_heads", None)
    if init_heads is not None:
        init_heads(drafter)
    heads = [n for n, _ in drafter.named_parameters() if n in set(missing)]
    if freeze:
        freeze_except(drafter, heads)
    return heads


def freeze_except(drafter: DFlashDrafter, trained: list[str]) -> None:
    keep = set(trained)
    for n, p in drafter.named_parameters():
        p.requires_grad_(n in keep)


def resume(ckpt: Path, state: dict | None, drafter: DFlashDrafter, opt, tap_scaling: bool) -> int:
    """The step to start from: 0, or a checkpoint's, after loading its weights, draft vocabulary and
    optimizer moments."""
    if state is None:
        return 0
    drafter.load_state_dict(DFlashDrafter.from_pretrained(ckpt).state_dict())
    if tap_scaling:  # the trained parameter itself: unfolding the saved weight would round
        drafter.fc.weight.data.copy_(state["fc_weight"])
    opt.load_state_dict(state["optimizer"])
    return int(state["step"])


def trainer_state(cfg, drafter: DFlashDrafter, opt, step: int, data_fp: str) -> dict:
    """What a checkpoint needs beside the drafter's files to resume exactly (see resume)."""
    extra = (
        {"tap_scale": drafter.fc.scale.cpu(), "fc_weight": drafter.fc.weight.detach().cpu().clone()}
        if cfg.tap_scaling
        else {}
    )
    trained = [n for n, p in drafter.named_parameters() if p.requires_grad]  # freeze_backbone: the heads
    return {
        "step": step,  # the global step: with the seed it fixes the data position at any world size
        "optimizer": opt.state_dict(),
        "config": asdict(cfg),
        "data_fingerprint": data_fp,
        "trained": trained,
        **extra,
    }
