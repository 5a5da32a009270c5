"""decoding/ngram.py against a slow obviously-correct search: the longest suffix seen before, its
first earlier occurrence, and the copied continuation (including one that runs into the text's end)."""

from __future__ import annotations

import random

from dflash_trt.decoding.ngram import SuffixIndex


def brute(text: list[int], k: int, min_match: int = 1) -> tuple[list[int], int]:
    """Longest suffix (shorter than the text) that also ends earlier; continuation after its first end."""
    L = len(text)
    for n in range(L - 1, min_match - 1, -1):
        suffix = text[L - n :]
        for end in range(n - 1, L - 1):  # earlier end positions, earliest first
            if text[end - n + 1 : end + 1] == suffix:
                pred = list(text)
                for i in range(k):
                    pred.append(pred[end + 1 + i])
                return pred[L:], n
    return [], 0


def test_matches_brute_force_on_random_texts():
    rng = random.Random(0)
    for trial in range(300):
        vocab = rng.choice([2, 3, 5, 50])
        text = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        idx = SuffixIndex()
        for i, t in enumerate(text):
            idx.append(t)
            k, m = rng.randrange(0, 6), rng.choice([1, 2, 3])
            got = idx.propose(k, m)
            exp_tokens, exp_n = brute(text[: i + 1], k, m)
            if k == 0:
                exp_tokens, exp_n = [], 0
            assert (got.tokens, got.match_len) == (exp_tokens, exp_n), (trial, text[: i + 1], k, m)


def test_copies_a_repeated_passage():
    prompt = [7, 1, 2, 3, 4, 5, 6, 9, 9]
    idx = SuffixIndex(prompt + [1, 2])
    got = idx.propose(4)
    assert got.tokens == [3, 4, 5, 6] and got.match_len == 2
    assert SuffixIndex([1, 2, 3]).propose(3).tokens == []  # nothing seen before


def test_periodic_continuation_runs_past_the_end():
    idx = SuffixIndex([5, 6, 5, 6, 5])
    assert idx.propose(5).tokens == [6, 5, 6, 5, 6]


def test_memory_is_linear():
    idx = SuffixIndex([i % 97 for i in range(2000)])
    assert len(idx.length) <= 2 * len(idx) + 1 and idx.nbytes() > 0
