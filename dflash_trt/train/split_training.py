"""`dflash-trt train --split-target`: training with the target split into pipeline stages over the
torchrun ranks (train/split_target.py), the ranks also the drafter's DDP ranks (train/distributed.py).

Boundary: the checks and the order of collective work around trainer.train; the trainer itself is
unchanged (its target_taps calls are collective through StageTarget). Kept apart from
split_target.py because it needs the trainer, which imports features, which imports split_target.
"""

from __future__ import annotations

from pathlib import Path

from dflash_trt.errors import ConfigError
from dflash_trt.train.data import data_folders, training_sequences
from dflash_trt.train.distill import feature_layers
from dflash_trt.train.features import offline_features
from dflash_trt.train.split_target import load_split_target
from dflash_trt.train.trainer import FAMILY_NAMES, _drafter_config, train


def train_split(cfg, progress: bool = True) -> Path:
    """`dflash-trt train --split-target` (under torchrun): cfg.target split over the ranks, which are
    also the drafter's DDP ranks. Refused up front, naming the field: what needs the target's whole
    forward (families with target-logit terms), validation (Validator runs on rank 0 alone), and a
    data size whose short last batch leaves a rank without sequences (every rank takes part in each
    pipeline pass). Offline features are built here by all ranks together before training, so the
    trainer's rank-0 build finds them complete."""
    if FAMILY_NAMES[cfg.family].TEACHER is not None:
        raise ConfigError(f"family={cfg.family}: its loss needs the target's logits per block; not with --split-target")
    if cfg.val_data:
        raise ConfigError("val_data: not with --split-target (validation runs on one rank); evaluate afterwards")
    seqs = training_sequences(cfg, data_folders(cfg))
    stage = load_split_target(cfg.target, cfg.dtype, cfg.device)
    short = len(seqs) % cfg.batch_size
    if 0 < short < stage.world:
        raise ConfigError(
            f"batch_size={cfg.batch_size}: the {len(seqs)} sequences leave a last batch of {short}, fewer than the "
            f"{stage.world} pipeline ranks; pick a batch_size dividing {len(seqs)} or leaving >= {stage.world}"
        )
    if cfg.features == "offline":
        dcfg, _ = _drafter_config(cfg, stage, seqs)
        layers = feature_layers(dcfg.target_layer_ids, stage.num_layers, cfg.kd_weight > 0)
        offline_features(cfg, stage, dcfg, seqs, Path(cfg.out), layers)
    return train(cfg, target=stage, progress=progress)
