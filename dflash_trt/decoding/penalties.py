"""Logit controls of a request (SamplingParams repetition / presence / frequency penalties, min_tokens,
bad_words_ids) applied to the target's logits, block position by block position, so that speculative
decoding stays lossless.

Boundary: the math (`penalize`, pure tensors in and out) and a request's running state (PenaltyState:
what the penalties count, updated with the tokens the request emits). SpecEngine (decoding/engine.py)
and the plain-decoding reference generate_baseline (decoding/loop.py) call `apply` on the logits they
choose from; acceptance itself is decoding/verify.py's, unchanged.

Why exact: block position i of [x0, d1..dK] predicts the token after d_i, so it is penalised with the
context prompt + output + d_1..d_i: the logits the target would penalise decoding token by token had
it emitted d_1..d_i. Acceptance only keeps a position's token when every draft before it was accepted,
so each emitted token is chosen from exactly plain decoding's penalised logits (greedy: their argmax;
sampling: rejection sampling with p = softmax(penalised / T), the drafter's q unchanged).

Definitions (vLLM's; TensorRT-LLM's penalty kernels match them since its PR #5623):
  repetition  over prompt + output tokens: logit / r where logit > 0, else logit * r (HF / CTRL)
  frequency   over output tokens: logit -= f * count
  presence    over output tokens: logit -= p * (count > 0)
  min_tokens  the stop tokens (StopRule's: stop_token_ids, plus EOS unless ignore_eos) get -inf while
              fewer than min_tokens tokens have been generated
  bad words   a word's last token gets -inf where the context (prompt + output, as TensorRT-LLM's ban
              words kernel matches it) ends with the word's other tokens; one-token words always
Token ids outside the target's vocabulary are ignored: the target can never produce them anyway.
"""

from __future__ import annotations

import torch

from dflash_trt.config import SamplingParams

NEG_INF = float("-inf")


class PenaltyState:
    """One request's running counts (output tokens so far) and its fixed masks, on the logits' device."""

    def __init__(self, params: SamplingParams, stops, prompt: list[int], vocab_size: int, device):
        V = vocab_size
        self.params = params
        self.counts = torch.zeros(V, dtype=torch.float32, device=device)  # [V] occurrences in the output
        self.seen = torch.zeros(V, dtype=torch.bool, device=device)  # [V] occurs in prompt or output
        self.seen[torch.tensor(prompt, dtype=torch.long, device=device)] = True
        self.n_generated = 0
        self.stop_mask = _mask(stops, V, device) if params.min_tokens else None  # [V] banned before min_tokens
        words = params.bad_words_ids
        self.always = _mask([w[0] for w in words if len(w) == 1], V, device)  # [V] one-token words
        self.words = [(list(w[:-1]), w[-1]) for w in words if len(w) > 1 and w[-1] < V]  # (prefix, banned)
        self.keep = max((len(p) for p, _ in self.words), default=0)  # context tokens the words look back
        self.tail = list(prompt)[-self.keep :] if self.keep else []

    @property
    def counted(self) -> bool:
        """The repetition / presence / frequency penalties change logits (else their math is skipped)."""
        p = self.params
        return p.repetition_penalty != 1.0 or bool(p.presence_penalty) or bool(p.frequency_penalty)

    def update(self, tokens: list[int]) -> None:
        """The request emitted `tokens` (after acceptance, stop rule applied)."""
        if not tokens:
            return
        t = torch.tensor(tokens, dtype=torch.long, device=self.counts.device)
        self.counts.index_add_(0, t, torch.ones(len(tokens), device=t.device))
        self.seen[t] = True
        self.n_generated += len(tokens)
        if self.keep:
            self.tail = (self.tail + list(tokens))[-self.keep :]


def state_for(params: SamplingParams, stops, prompt: list[int], vocab_size: int, device) -> PenaltyState | None:
    """A request's state, or None when it sets no logit control (its logits are then used untouched)."""
    return PenaltyState(params, stops, prompt, vocab_size, device) if params.has_logit_controls else None


def _mask(ids, V: int, device) -> torch.Tensor:
    m = torch.zeros(V, dtype=torch.bool, device=device)
    ids = [int(i) for i in ids if 0 <= int(i) < V]
    if ids:
        m[torch.tensor(ids, device=device)] = True
    return m


def _rule(x, count, seen, rep, pres, freq):
    """The penalties on logits x given each token's output count and whether the context holds it. One
    function for the whole-vocabulary and the draft-column paths, so that both give identical bits."""
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    return x - freq * count - pres * (count > 0)


def penalize(
    logits: torch.Tensor,  # [R, W, V] target logits of the block positions
    counts: torch.Tensor | None,  # [R, V] float, occurrences of each token in the output (None: no penalty)
    seen: torch.Tensor | None,  # [R, V] bool, token occurs in the prompt or the output
    drafts: torch.Tensor,  # [R, W-1] the block's drafts: position i follows drafts[:, :i]
    n_generated: torch.Tensor,  # [R] int64, output tokens before position 0's token
    repetition: torch.Tensor,  # [R] float
    presence: torch.Tensor,  # [R] float
    frequency: torch.Tensor,  # [R] float
    min_tokens: torch.Tensor,  # [R] int64
    stop_mask: torch.Tensor | None,  # [R, V] bool, the tokens min_tokens holds back (None: none)
    banned: torch.Tensor | None = None,  # [R, W, V] bool, bad words' -inf (None: none)
) -> torch.Tensor:
    """Penalised float32 logits [R, W, V]: position i as if the drafts before it had been emitted."""
    R, W, V = logits.shape
    K = W - 1
    x = logits.float()
    if counts is None:  # min_tokens / bad words only
        out = x.clone()
    else:
        rep, pres, freq = (v.float().view(R, 1, 1) for v in (repetition, presence, frequency))
        out = _rule(x, counts[:, None], seen[:, None], rep, pres, freq)  # the counts before the block, everywhere
    if K and counts is not None:
        # only the draft tokens' columns change along the block: position i adds d_1..d_i to their counts.
        # A draft that is not a token (-1, past a row's length) is never accepted, so the positions after
        # it are never used: clamping it to a valid column changes no emitted token.
        d = drafts.clamp(0, V - 1)  # [R, K]
        same = d[:, :, None] == d[:, None, :]  # [R, K(column j), K(draft j')]
        before = torch.arange(K, device=d.device)[None, :] < torch.arange(W, device=d.device)[:, None]  # [W, K]
        extra = (same[:, None] & before[None, :, None, :]).sum(-1).float()  # [R, W, K] d_j among d_1..d_i
        cnt = counts.gather(1, d)[:, None, :] + extra
        sn = seen.gather(1, d)[:, None, :] | (extra > 0)
        cols = d[:, None, :].expand(R, W, K)
        # duplicate columns of one position get identical values, so the scatter's order does not matter
        out.scatter_(2, cols, _rule(x.gather(2, cols), cnt, sn, rep, pres, freq))
    if stop_mask is not None:
        early = n_generated[:, None] + torch.arange(W, device=logits.device)[None, :] < min_tokens[:, None]  # [R, W]
        out.masked_fill_(early[:, :, None] & stop_mask[:, None, :], NEG_INF)
    if banned is not None:
        out.masked_fill_(banned, NEG_INF)
    return out


def bad_word_bans(states: list[PenaltyState], drafts: list[list[int]], W: int, V: int, device) -> torch.Tensor:
    """[R, W, V] bool: the tokens bad words ban at each block position; position i's context is the
    request's context followed by drafts[r][:i]. drafts: [R][W-1] token ids."""
    banned = torch.stack([s.always for s in states])[:, None, :].expand(-1, W, -1).clone()  # [R, W, V]
    rows, pos, toks = [], [], []
    for r, s in enumerate(states):
        ctx = s.tail + drafts[r]
        for i in range(W):
            end = len(s.tail) + i  # ctx[:end] precedes position i's token
            for prefix, tok in s.words:
                n = len(prefix)
                if end >= n and ctx[end - n : end] == prefix:
                    rows.append(r), pos.append(i), toks.append(tok)
    if toks:
        banned[torch.tensor(rows), torch.tensor(pos), torch.tensor(toks)] = True
    return banned


def apply(logits: torch.Tensor, drafts: torch.Tensor | None, states: list[PenaltyState | None]) -> torch.Tensor:
    """The rows' logits [R, W, V] with their requests' controls applied (float32), or `logits` itself when
    no row sets any. drafts [R, W-1] (None when W = 1); states: per row, None for a row without controls
    (its logits stay as they are, up to the exact cast to float32)."""
    rows = [r for r, s in enumerate(states) if s is not None]
    if not rows:
        return logits
    R, W, V = logits.shape
    dev = logits.device
    st = [states[r] for r in rows]
    idx = torch.tensor(rows, device=dev)
    sub = logits[idx]  # [A, W, V]
    d = drafts[idx] if drafts is not None else torch.zeros(len(rows), 0, dtype=torch.long, device=dev)
    counts = seen = stop_mask = banned = None  # each part runs only when some row needs it
    if any(s.counted for s in st):  # a row without penalties: count 0, seen nowhere, rule is the identity
        counts = torch.stack([s.counts if s.counted else torch.zeros_like(s.counts) for s in st])
        seen = torch.stack([s.seen if s.counted else torch.zeros_like(s.seen) for s in st])
    if any(s.stop_mask is not None for s in st):
        off = torch.zeros(V, dtype=torch.bool, device=dev)
        stop_mask = torch.stack([off if s.stop_mask is None else s.stop_mask for s in st])
    if any(s.params.bad_words_ids for s in st):
        banned = bad_word_bans(st, d.tolist(), W, V, dev)

    def per_row(f):
        return torch.tensor([f(s.params) for s in st], device=dev)

    pen = penalize(
        sub,
        counts,
        seen,
        d,
        torch.tensor([s.n_generated for s in st], device=dev),
        per_row(lambda p: p.repetition_penalty),
        per_row(lambda p: p.presence_penalty),
        per_row(lambda p: p.frequency_penalty),
        per_row(lambda p: p.min_tokens),
        stop_mask,
        banned,
    )
    if len(rows) == R:
        return pen
    out = logits.float().clone()
    out[idx] = pen
    return out
