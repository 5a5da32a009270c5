"""N-gram / suffix drafts from a request's own text: the longest suffix of the text so far (prompt +
output) that occurred earlier, and the tokens that followed that earlier occurrence.

Boundary: one request's index and its proposal (token ids in, token ids out); no model, no
tensors. How a proposal competes with the drafter's block is the engine's business.

Why a suffix automaton: it is the smallest structure that answers "longest suffix of the text seen
before, and where" after every appended token in amortised constant time and linear memory (each
token adds at most two states). A rolling-hash table per n-gram length answers only for the lengths
it indexes and costs one table insert per length per token; the automaton gives the longest match
of any length. For each state we keep the end position of its first occurrence (`first`): the
state of the text's longest earlier-seen suffix is the suffix link of the whole text's state, so
the continuation starts right after `first` of that link. The first occurrence rather than the
latest: keeping the latest would mean walking suffix links on every append (not constant work);
for text that repeats a passage verbatim both give the same continuation.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class NgramProposal:
    tokens: list[int]  # the continuation, at most the requested number
    match_len: int  # tokens of the matched suffix (0: no match, tokens is empty)


class SuffixIndex:
    """Incremental suffix automaton over a token sequence."""

    def __init__(self, tokens: list[int] | None = None):
        self.text: list[int] = []
        self.length = [0]  # per state: length of its longest string
        self.link = [-1]  # per state: suffix link
        self.next: list[dict[int, int]] = [{}]  # per state: transitions
        self.first = [-1]  # per state: end position (index into text) of its first occurrence
        self.last = 0  # the state of the whole text
        self.extend(tokens or [])

    def __len__(self) -> int:
        return len(self.text)

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self.append(int(t))

    def append(self, tok: int) -> None:
        """Add one token (amortised O(1): the standard online construction)."""
        pos = len(self.text)
        self.text.append(tok)
        cur = self._new(self.length[self.last] + 1, pos)
        p = self.last
        while p != -1 and tok not in self.next[p]:
            self.next[p][tok] = cur
            p = self.link[p]
        if p == -1:
            self.link[cur] = 0
        else:
            q = self.next[p][tok]
            if self.length[p] + 1 == self.length[q]:
                self.link[cur] = q
            else:  # split q: the clone keeps q's transitions and first occurrence
                clone = self._new(self.length[p] + 1, self.first[q])
                self.next[clone] = dict(self.next[q])
                self.link[clone] = self.link[q]
                while p != -1 and self.next[p].get(tok) == q:
                    self.next[p][tok] = clone
                    p = self.link[p]
                self.link[q] = self.link[cur] = clone
        self.last = cur

    def _new(self, length: int, first: int) -> int:
        self.length.append(length)
        self.link.append(-1)
        self.next.append({})
        self.first.append(first)
        return len(self.length) - 1

    def propose(self, k: int, min_match: int = 1) -> NgramProposal:
        """Up to k tokens that followed the earliest earlier occurrence of the text's longest
        earlier-seen suffix (of at least min_match tokens)."""
        s = self.link[self.last] if self.text else -1
        n = self.length[s] if s > 0 else 0
        if n < min_match or k <= 0:
            return NgramProposal([], 0)
        start = self.first[s] + 1  # < len(text): the occurrence ended before the text's end
        out = self.text[start : start + k]
        # the continuation may run into the text's end: the match then repeats with period
        # len(text) - start, and the copy continues through the tokens it is producing
        period = len(self.text) - start
        while len(out) < k:  # here len(out) >= period
            out.append(out[len(out) - period])
        return NgramProposal(out, n)

    def nbytes(self) -> int:
        """Approximate memory held (Python objects), for the per-1K-token cost in the docs."""
        per_list = sum(sys.getsizeof(x) for x in (self.text, self.length, self.link, self.first, self.next))
        return per_list + sum(sys.getsizeof(d) for d in self.next)
