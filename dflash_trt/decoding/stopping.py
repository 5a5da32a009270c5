"""StopRule: when a generated row is finished, and where its emitted tokens are cut.

Boundary: the one rule that SpecEngine (decoding/engine.py) and generate_baseline
(decoding/loop.py) both apply to every token they emit, so that DFlash and plain decoding stop at
the same token. Token-id stop sequences of the serving front doors (serving/orchestrator.py) are a
text-level rule on top of this one and live there.

A row ends at the first of:
  "stop"    the token just emitted is a stop token (the request's stop_token_ids, plus the
            model's EOS ids unless ignore_eos); the stop token is kept in the output
  "length"  the output holds max_new_tokens tokens, or prompt + output fills the context
            (max_len: the engine's max_seq_len / the baseline's cache capacity)
Tokens after the one that ended the row are dropped (a verify step can accept past it).

The model's EOS ids have one home, modeling/stop_ids.py `model_stop_ids` (see its docstring for the
rule): the target adapter computes them at load (modeling/target.py `stop_ids`, with the tokenizer read
from the model folder by `tokenizer_stops`, without transformers), so the in-process loops and the served engine
(serving/engine_factory.py) stop at the same ids; api.stop_ids(tokenizer) is the same rule over a
loaded tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_trt.config import SamplingParams
from dflash_trt.errors import DFlashError
from dflash_trt.modeling.stop_ids import model_stop_ids


@dataclass(frozen=True)
class StopRule:
    stops: frozenset[int]
    max_new_tokens: int
    num_prompt: int
    max_len: int  # prompt + output tokens may not exceed this

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise DFlashError(f"StopRule.max_new_tokens={self.max_new_tokens}: must be >= 1")
        # a prompt that fills max_len is the caller's to refuse (decoding/prompt.py): the rule
        # then ends the row after its first token

    @classmethod
    def for_request(cls, params: SamplingParams, eos: frozenset[int], num_prompt: int, max_len: int) -> StopRule:
        """The request's stop ids, with the model's EOS ids unless params.ignore_eos."""
        stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(eos))
        return cls(stops, params.max_new_tokens, num_prompt, max_len)

    def admit(self, num_out: int, tokens: list[int]) -> tuple[int, str | None]:
        """A row that has emitted num_out tokens is offered `tokens` next: -> how many of them it
        keeps, and its finish reason ("stop" | "length") if one of them ends it, else None."""
        for i, t in enumerate(tokens):
            n = num_out + i + 1  # output length with this token
            if t in self.stops:
                return i + 1, "stop"
            if n >= self.max_new_tokens or self.num_prompt + n >= self.max_len:
                return i + 1, "length"
        return len(tokens), None


def target_stop_ids(target) -> frozenset[int]:
    """The default stop ids of a target adapter: its `stop_ids` (TargetModel), else the rule over its
    configs alone (test doubles built without a model folder)."""
    ids = getattr(target, "stop_ids", None)
    if ids is not None:
        return frozenset(ids)
    hf = getattr(target, "hf", None)
    return model_stop_ids(getattr(target, "config", None), getattr(hf, "generation_config", None), None)
