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

REPLACEMENT = "\ufffd"  # what a decoder writes for bytes that are not (yet) a whole UTF-8 character


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
    """Engine-side matcher of one request: find the output token whose text completes a stop string.

    Incremental, as vLLM's stop-string check: each call decodes only a window of the last ids, so a
    request's total work grows linearly with its output, not quadratically. The window ids[lo:]
    starts early enough that its text before the new tokens holds HEAD_SLACK + the longest stop's
    length in characters: a window starting inside a multi-byte character (or a SentencePiece word)
    decodes its first characters differently from the full text (U+FFFD, a dropped leading space),
    so matches are searched only from the window character where a stop string that the text of
    ids[:start] did not hold can begin, past those first characters. Exact for decoders whose
    text only grows but for trailing U+FFFD (byte-level BPE, SentencePiece with byte fallback),
    the rule serving/text.py's streaming rests on too."""

    HEAD_SLACK = 8  # characters: > the 1-4 a window start can garble (orphan UTF-8 bytes, a leading space)
    FIRST_WINDOW = 8  # tokens decoded before `start` on the first try; doubled until the text is long enough

    def __init__(self, codec, words: Sequence[str]):
        self.codec = codec
        self.stops = clean_stops(words)
        self.longest = max((len(s) for s in self.stops), default=0)

    def __bool__(self) -> bool:
        return bool(self.stops)

    def match(self, ids: Sequence[int], start: int) -> int | None:
        """ids: the request's output so far, of which ids[:start] were checked before (by this method,
        finding no stop string). Returns the number of ids to keep (through the token completing the
        first stop string), or None."""
        if not self.stops or len(ids) <= start:
            return None
        lo, at = self._window(ids, start)
        if find_stop(self.codec.decode(ids[lo:]), self.stops, at) is None:
            return None
        # a stop string ends after ids[:start]: the first token that completes it
        for k in range(max(start, 1), len(ids)):
            if find_stop(self.codec.decode(ids[lo:k]), self.stops, at) is not None:
                return k
        return len(ids)

    def _window(self, ids: Sequence[int], start: int) -> tuple[int, int]:
        """(lo, at): ids[lo:] decoded holds every stop string completed after ids[:start] at a
        character index >= at. A stop string absent from the text of ids[:start] must end past that
        text's stable part (U+FFFD at its end may be a character later tokens complete), so it
        begins at most len(stop) - 1 characters before that part's end."""
        n = self.FIRST_WINDOW
        while True:
            lo = max(0, start - n)
            before = self.codec.decode(ids[lo:start]).rstrip(REPLACEMENT)
            if lo == 0 or len(before) >= self.longest + self.HEAD_SLACK:
                return lo, max(0, len(before) - self.longest + 1)
            n *= 2
