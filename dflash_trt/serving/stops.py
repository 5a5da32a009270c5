"""Text-level stop strings (`stop_words`), as vLLM and tensorrtllm_backend treat them.

Boundary: pure string / token-id logic over a TextCodec; no Triton, no torch. Two users:

* the engine model (`dflash`, through the Orchestrator): `TextStop` finds the first output token
  whose text completes a stop string, so the engine request ends there (no wasted steps) and the
  ids after that token are never sent nor counted;
* the text layers (`dflash_bls` / `dflash_unary` through StreamDetokenizer, the ensemble's
  stateless `postprocessing` through text_delta): `cut()` drops the stop string and everything
  after it, and while a request runs `holdback()` keeps back the longest tail of the text that is
  the start of some stop string, so a streamed chunk never shows text that turns out to be part of
  a stop string.

Why text and not token ids: a stop word tokenized on its own ("Paris") is rarely the token the
model writes (" Paris", "Paris."), so matching ids of the word alone misses most stops.
The output token count is the tokens up to and including the one that completes the stop string
(vLLM's convention): they were generated and sent, the text of the stop string is not shown.
"""

from __future__ import annotations

from collections.abc import Sequence


def clean_stops(words: Sequence[str]) -> tuple[str, ...]:
    """The non-empty stop strings, in order, without duplicates."""
    return tuple(dict.fromkeys(w for w in words if w))


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> int | None:
    """Index in text of the earliest stop string that begins at or after `start`, or None."""
    best = None
    for s in stops:
        i = text.find(s, start)
        if i >= 0 and (best is None or i < best):
            best = i
    return best


def holdback(text: str, stops: Sequence[str], start: int = 0) -> int:
    """Length of the longest suffix of text[start:] that is a proper prefix of a stop string."""
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text) - start), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


def cut(text: str, stops: Sequence[str], final: bool, start: int = 0) -> tuple[str, bool]:
    """The text a client may see now: (text before the first stop string, True) when one occurs
    after `start`; else (text, False) with the possible start of a stop string held back unless
    final."""
    if not stops:
        return text, False
    i = find_stop(text, stops, start)
    if i is not None:
        return text[:i], True
    return (text if final else text[: len(text) - holdback(text, stops, start)]), False


class TextStop:
    """Engine-side matcher of one request: decode the output ids, find where a stop string ends."""

    def __init__(self, codec, words: Sequence[str]):
        self.codec = codec
        self.stops = clean_stops(words)

    def __bool__(self) -> bool:
        return bool(self.stops)

    def match(self, ids: Sequence[int], start: int) -> int | None:
        """ids: the request's output so far, of which ids[:start] were checked before. Returns the
        number of ids to keep (through the token completing the first stop string), or None."""
        if not self.stops or len(ids) <= start:
            return None
        if find_stop(self.codec.decode(ids), self.stops) is None:
            return None
        # the stop was not in ids[:start] (checked last step): find the first token that completes it
        for k in range(max(start, 1), len(ids) + 1):
            if find_stop(self.codec.decode(ids[:k]), self.stops) is not None:
                return k
        return len(ids)
