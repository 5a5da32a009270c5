"""Teacher-forced training data from existing text: one target forward per chunk, no regeneration.

Boundary: text in (the standard library's own source code, or the user's files), sequences out in
data.py's data-*.jsonl layout plus "target_next": the target's greedy next token after every
position. The trainer turns that into labels and a label mask (objective.make_blocks).

Why: regenerating answers (`data generate`) costs one target decode step per token, about 27
answer tokens/s for a 0.5B target on a 2-core CPU; scoring existing text costs a share of one
prefill, about 140 tokens/s there, over text of any variety and amount. The text is not what the target
would write, so the labels are the target's own greedy predictions, and a block position counts
only while the text agrees with them: for a block anchored at a, the label of position k is the
target's argmax after x_{<=a+k-1}, which is the token greedy decoding would produce only when
x_{a+1..a+k-1} are themselves the target's greedy tokens. Position 1 is always exact. (EAGLE-style
training on fixed text uses the text's own tokens as labels; those are wrong wherever the target
disagrees, for a 0.5B coder on library code about 45% of tokens.)

Held out: the standard library is not a benchmark set; HumanEval and WritingBench never come from here.
"""

from __future__ import annotations

import importlib
import inspect
import json
from pathlib import Path

import torch
from tqdm import tqdm

from dflash_trt.errors import DFlashError
from dflash_trt.train.data import fill_shards
from dflash_trt.train.features import target_taps
from dflash_trt.train.prompts import MORE_STDLIB_MODULES, STDLIB_MODULES

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")
MIN_CHUNK = 64  # shorter tails of a text are dropped: too little context to anchor blocks in


def stdlib_sources() -> list[str]:
    """Source files of STDLIB_MODULES then MORE_STDLIB_MODULES (each file once, in that order)."""
    texts, seen = [], set()
    for name in STDLIB_MODULES + MORE_STDLIB_MODULES:
        try:
            path = inspect.getsourcefile(importlib.import_module(name))
        except (ImportError, TypeError):  # missing here, or a C module without source
            continue
        if path and path not in seen and Path(path).is_file():
            seen.add(path)
            texts.append(Path(path).read_text(encoding="utf-8", errors="replace"))
    return texts


def load_texts(source: str) -> list[str]:
    """`stdlib-src` (the standard library's source), a text file (.py/.txt/.md/.rst: one text), a .jsonl
    file ({"text": ...} per line) or a folder (its text files, recursively, sorted by path)."""
    if source == "stdlib-src":
        return stdlib_sources()
    p = Path(source)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
        texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    elif p.is_file() and p.suffix == ".jsonl":
        texts = []
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                texts.append(str(json.loads(line)["text"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise DFlashError(f'{p}:{i}: expected a JSON object with a "text" field') from None
    elif p.is_file():
        texts = [p.read_text(encoding="utf-8", errors="replace")]
    else:
        raise DFlashError(
            f"text source {source!r}: not a file or folder and not a built-in source (built-in: stdlib-src)"
        )
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise DFlashError(f"text source {source}: no text in it (folders are searched for {', '.join(TEXT_SUFFIXES)})")
    return texts


def chunk_texts(tokenizer, texts: list[str], seq_len: int, limit: int | None = None) -> list[list[int]]:
    """Each text tokenized and cut into consecutive windows of seq_len tokens (a tail shorter than
    MIN_CHUNK is dropped), then taken round-robin (window 0 of every text, then window 1, ...), so
    that a --limit samples every source rather than the first few long files; the first `limit`."""
    if seq_len < MIN_CHUNK:
        raise DFlashError(f"--seq-len {seq_len}: must be >= {MIN_CHUNK}")
    per_text = []
    for text in tqdm(texts, desc="tokenizing", disable=len(texts) < 100):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        per_text.append([ids[i : i + seq_len] for i in range(0, len(ids), seq_len) if len(ids) - i >= MIN_CHUNK])
    chunks = [w[i] for i in range(max(map(len, per_text), default=0)) for w in per_text if i < len(w)]
    return chunks[:limit] if limit else chunks


@torch.no_grad()
def greedy_next(target, seqs: list[list[int]], chunk: int = 128) -> list[list[int]]:
    """The target's argmax after every position of each sequence (right-padded batch; padding is
    causal-invisible) -> one list per sequence, as long as it. The LM head runs on `chunk` positions
    at a time: full fp32 logits of a batch would be N*S*V*4 bytes (1.2 GB for 4 x 512 x 152K)."""
    # the last layer's tap is the final hidden state after the final norm (transformers' hidden_states[L])
    hidden = target_taps(target, seqs, [target.num_layers - 1])  # [N, S, d]
    best = torch.cat(
        [target.lm_head(hidden[:, i : i + chunk]).argmax(-1).cpu() for i in range(0, hidden.shape[1], chunk)], 1
    )
    return [best[r, : len(s)].tolist() for r, s in enumerate(seqs)]


def score_corpus(
    target,
    tokenizer,
    texts: list[str],
    out_dir: str | Path,
    seq_len: int = 512,
    limit: int | None = None,
    batch_size: int = 4,
    shard_size: int = 256,
    progress: bool = True,
) -> Path:
    """Windows of `texts` with the target's greedy next tokens -> out_dir/data-NNNNN.jsonl lines
    {"input_ids", "prompt_len": 1, "target_next"}. Resumable like data.generate_data: finished
    shards are kept, a shorter last shard is extended."""
    chunks = chunk_texts(tokenizer, texts, seq_len, limit)
    if not chunks:
        raise DFlashError(f"no text window of >= {MIN_CHUNK} tokens in the source")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    def score(batch: list[list[int]]) -> list[str]:
        return [
            json.dumps({"input_ids": s, "prompt_len": 1, "target_next": nxt})
            for s, nxt in zip(batch, greedy_next(target, batch))
        ]

    bar = tqdm(total=sum(map(len, chunks)), desc="scoring text with the target", unit="tok", disable=not progress)
    fill_shards(out, chunks, shard_size, batch_size, score, bar, weight=len)
    bar.close()
    return out


def agreement(seqs: list[dict]) -> float | None:
    """Share of text tokens equal to the target's greedy prediction (sequences with target_next only)."""
    hit = total = 0
    for s in seqs:
        nxt = s.get("target_next")
        if nxt:
            ids = s["input_ids"]
            hit += sum(int(a == b) for a, b in zip(ids[1:], nxt[:-1]))
            total += len(ids) - 1
    return hit / total if total else None
