"""Cost of the n-gram index (dflash_trt/decoding/ngram.py) next to a decode step: time per appended
token, time per proposal, and memory per 1K tokens, on token streams of real text (the package's own
source, tokenized by the SmolLM2 tokenizer when it is cached, else bytes) and on random tokens
(the automaton's worst case for state count).

    .venv/bin/python scripts/bench_ngram_index.py [--tokens 20000] [--json-out docs/bench_runs/ngram_index.json]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from transformers import AutoTokenizer

from dflash_trt.decoding.ngram import SuffixIndex
from dflash_trt.hub.models import models_home

ROOT = Path(__file__).resolve().parents[1]


def text_tokens(n: int) -> tuple[str, list[int]]:
    """Tokens of this repository's Python source: code repeats itself, as the hybrid proposer expects."""
    text = "\n".join(p.read_text() for p in sorted((ROOT / "dflash_trt").rglob("*.py")))
    folder = models_home() / "models" / "smollm2-135m-instruct"
    if (folder / "tokenizer.json").is_file():  # the real tokenizer when the model is cached (no download here)
        tok = AutoTokenizer.from_pretrained(folder)
        return "SmolLM2 tokens of dflash_trt/*.py", tok(text)["input_ids"][:n]
    return "bytes of dflash_trt/*.py", list(text.encode())[:n]


def measure(tokens: list[int], block: int = 16) -> dict:
    idx = SuffixIndex()
    t0 = time.perf_counter()
    for t in tokens:
        idx.append(t)
    append = (time.perf_counter() - t0) / len(tokens)
    t0, proposed = time.perf_counter(), 0
    for _ in range(2000):
        proposed += len(idx.propose(block - 1, 2).tokens)
    propose = (time.perf_counter() - t0) / 2000
    return {
        "tokens": len(tokens),
        "states": len(idx.length),
        "append_us_per_token": append * 1e6,
        "propose_us": propose * 1e6,
        "bytes_per_1k_tokens": idx.nbytes() / len(tokens) * 1000,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args()
    source, real = text_tokens(a.tokens)
    rng = random.Random(0)
    rows = {source: measure(real), "random tokens (vocab 50k)": measure([rng.randrange(50000) for _ in real])}
    print(f"{'stream':<36} {'tokens':>7} {'states':>7} {'append us/tok':>14} {'propose us':>11} {'KiB/1K tok':>11}")
    for name, r in rows.items():
        print(
            f"{name:<36} {r['tokens']:>7} {r['states']:>7} {r['append_us_per_token']:>14.2f} "
            f"{r['propose_us']:>11.2f} {r['bytes_per_1k_tokens'] / 1024:>11.1f}"
        )
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
