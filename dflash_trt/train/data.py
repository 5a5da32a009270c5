"""Training data on disk: target-regenerated responses as sharded jsonl, and reading shards back.

Boundary: text prompts in (from train/prompts.py or the user), token sequences out
({"input_ids": [...], "prompt_len": P} per line; the loss mask is "position >= prompt_len"; lines
made from existing text by corpus.py also carry "target_next", the target's greedy next tokens,
which then serve as the labels). Responses are the target's own continuations, so the drafter
learns the distribution it will be verified against. Shards are written atomically and resumably.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tqdm import tqdm

from dflash_trt.api import encode, stop_ids
from dflash_trt.config import SamplingParams
from dflash_trt.decoding.loop import generate_baseline
from dflash_trt.errors import ConfigError, DFlashError
from dflash_trt.train.objective import trainable


def read_sequences(data_dir: str | Path) -> list[dict]:
    """All sequences of a data folder's shards (data-*.jsonl), validated."""
    d = Path(data_dir)
    shards = sorted(d.glob("data-*.jsonl")) if d.is_dir() else ([d] if d.is_file() else [])
    if not shards:
        raise DFlashError(f"training data {d}: no data-*.jsonl shards (make them with `dflash-trt data generate`)")
    seqs = []
    for shard in shards:
        for i, line in enumerate(shard.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                ids, P = [int(t) for t in obj["input_ids"]], int(obj["prompt_len"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                raise DFlashError(
                    f'{shard}:{i}: malformed line; expected {{"input_ids": [...], "prompt_len": N}}'
                ) from None
            if not 0 < P <= len(ids):
                raise DFlashError(f"{shard}:{i}: prompt_len={P} outside 1..{len(ids)}")
            seq = {"input_ids": ids, "prompt_len": P}
            if "target_next" in obj:  # teacher-forced text (corpus.py): the target's greedy next tokens
                nxt = obj["target_next"]
                if not isinstance(nxt, list) or len(nxt) != len(ids):
                    raise DFlashError(
                        f"{shard}:{i}: target_next must list one token per input_ids entry "
                        f"({len(ids)}); remake the shard with `dflash-trt data score`"
                    )
                seq["target_next"] = [int(t) for t in nxt]
            seqs.append(seq)
    if not seqs:
        raise DFlashError(f"training data {d}: shards are empty")
    return seqs


def generate_data(
    target,
    tokenizer,
    prompts: list[str],
    out_dir: str | Path,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    chat: bool = True,
    shard_size: int = 256,
    temperature: float = 0.0,
    seed: int = 0,
    progress: bool = True,
) -> Path:
    """The target answers every prompt; sequences go to out_dir/data-NNNNN.jsonl, shard_size per shard.
    Resumable: shards already written (atomically) are kept and their prompts skipped; a shorter
    last shard (the prompt list grew at the end since) is extended with the new prompts only."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    params = SamplingParams(
        temperature=temperature, max_new_tokens=max_new_tokens, seed=seed, stop_token_ids=stop_ids(tokenizer)
    )

    def answer(batch: list[str]) -> list[str]:
        enc = [encode(tokenizer, p, chat) for p in batch]
        res = generate_baseline(target, enc, params)
        return [json.dumps({"input_ids": ids + toks, "prompt_len": len(ids)}) for ids, toks in zip(enc, res.tokens)]

    bar = tqdm(total=len(prompts), desc="regenerating responses", disable=not progress)
    fill_shards(out, prompts, shard_size, batch_size, answer, bar)
    bar.close()
    return out


def fill_shards(out: Path, items: list, shard_size: int, batch_size: int, produce, bar, weight=lambda item: 1) -> None:
    """Resumable sharded output of `data generate` and `data score`: one line per item, in order, to
    out/data-NNNNN.jsonl, shard_size per shard; produce(batch of items) -> their lines. Shards already
    written (atomically) are kept and their items skipped; a shorter last shard (the item list grew
    at the end since) is extended with the new items only. The bar advances by weight(item)."""
    for i in range((len(items) + shard_size - 1) // shard_size):
        part = items[i * shard_size : (i + 1) * shard_size]
        lines = shard_lines(out, i)
        bar.update(sum(map(weight, part[: len(lines)])))
        if len(lines) >= len(part):
            continue
        for start in range(len(lines), len(part), batch_size):
            batch = part[start : start + batch_size]
            lines += produce(batch)
            bar.update(sum(map(weight, batch)))
        write_shard(out, i, lines)


def shard_lines(out: Path, index: int) -> list[str]:
    """The lines of shard `index` written so far (none when it does not exist)."""
    shard = out / f"data-{index:05d}.jsonl"
    return [ln for ln in shard.read_text().splitlines() if ln.strip()] if shard.is_file() else []


def write_shard(out: Path, index: int, lines: list[str]) -> None:
    """out/data-NNNNN.jsonl, whole or not at all: written beside it, then renamed over it (readers
    glob data-*.jsonl, so a killed writer's .tmp is never read, and the next run overwrites it)."""
    path = out / f"data-{index:05d}.jsonl"
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        f.write("\n".join(lines) + "\n")
        f.flush()
        os.fsync(f.fileno())  # the rename must not land before the data on a crash
    tmp.replace(path)


VALIDATION_MARKER = "VALIDATION"  # in a data folder made for validation: never used as training data


def mark_validation(folder: str | Path, source: str) -> None:
    Path(folder, VALIDATION_MARKER).write_text(json.dumps({"source": source}) + "\n")


def is_validation(folder: str | Path) -> bool:
    return Path(folder, VALIDATION_MARKER).is_file()


def data_folders(cfg) -> list[str]:
    """A TrainConfig's data folders; refused when none is given, or when one is a validation set (or val_data)."""
    if not cfg.out:
        raise ConfigError("out: give an output folder")
    folders = [f for f in cfg.data.split(",") if f.strip()]
    if not folders:
        raise ConfigError("data: give a data folder (dflash-trt data generate / data score)")
    for folder in folders:
        if is_validation(folder):
            raise ConfigError(
                f"data {folder}: this is a validation set (made with --validation, from held-out "
                f"prompts); train on other data and pass it as val_data instead"
            )
        if cfg.val_data and Path(cfg.val_data).resolve() == Path(folder).resolve():
            raise ConfigError(
                f"val_data {cfg.val_data}: is the training data itself; held-out metrics need other "
                f"sequences (dflash-trt data generate --validation)"
            )
    return folders


def training_sequences(cfg, folders: list[str]) -> list[dict]:
    """The folders' sequences with a response of at least one block, cut to max_seq_len."""
    seqs = [s for folder in folders for s in read_sequences(folder) if trainable(s, cfg.block_size)]
    if not seqs:
        raise ConfigError(
            f"data {cfg.data}: no sequence has a response of >= block_size={cfg.block_size} tokens; "
            f"generate longer responses or lower block_size"
        )
    for s in seqs:
        s["input_ids"] = s["input_ids"][: cfg.max_seq_len]
        if "target_next" in s:
            s["target_next"] = s["target_next"][: cfg.max_seq_len]
    return seqs
