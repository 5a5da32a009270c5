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

The model's EOS ids have one home, `model_stop_ids` (see its docstring for the rule): the target
adapter computes them at load (modeling/target.py `stop_ids`, with the tokenizer read from the model
folder by `tokenizer_stops`, without transformers), so the in-process loops and the served engine
(serving/engine_factory.py) stop at the same ids; api.stop_ids(tokenizer) is the same rule over a
loaded tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from dflash_trt.config import SamplingParams
from dflash_trt.errors import CheckpointError, DFlashError

# what instruct models write at the end of a turn (ChatML, Qwen/SmolLM base, Llama 3): often not the
# tokenizer's or the config's eos_token, so a chat reply would run on into a next invented turn
CHAT_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>")


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


def _id_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def model_stop_ids(
    config, generation_config, vocab: Mapping[str, int] | None, tokenizer_eos_id: int | None = None
) -> frozenset[int]:
    """The token ids that end generation by default (unless ignore_eos): the union of
    config.eos_token_id, generation_config.eos_token_id (int or list), the tokenizer's eos id, and
    the ids of CHAT_END_TOKENS that `vocab` (token -> id) holds. Any argument may be None.

    Why the union: Hugging Face generate() stops on generation_config's eos ids, vLLM on those plus
    the tokenizer's eos, and checkpoints disagree about which to fill in; the chat end tokens are what
    an instruct model writes at the end of a turn even where no config names them (SmolLM2-Instruct
    names only <|im_end|>, id 2, and still ends text with <|endoftext|>, id 0, its base model's EOS).
    Stopping early on a token that ends text costs nothing; missing one runs the reply on into an
    invented next turn until max_new_tokens.
    """
    ids = _id_list(getattr(config, "eos_token_id", None)) + _id_list(getattr(generation_config, "eos_token_id", None))
    ids += _id_list(tokenizer_eos_id)
    if vocab is not None:
        ids += [int(vocab[t]) for t in CHAT_END_TOKENS if t in vocab and vocab[t] is not None]
    return frozenset(ids)


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not readable JSON ({e})") from None


def _token_text(v) -> str | None:
    return v.get("content") if isinstance(v, dict) else v


def tokenizer_stops(folder: str | Path) -> tuple[dict[str, int], int | None]:
    """(the CHAT_END_TOKENS the tokenizer in `folder` holds -> their ids, its eos id), read from
    tokenizer.json with the `tokenizers` library, else from tokenizer_config.json's added tokens:
    no transformers import (the served engine loads no tokenizer otherwise). ({}, None) where the
    folder has no tokenizer files."""
    folder = Path(folder)
    cfg = _json(folder / "tokenizer_config.json")
    eos = _token_text(cfg.get("eos_token")) or _token_text(_json(folder / "special_tokens_map.json").get("eos_token"))
    if (folder / "tokenizer.json").is_file():
        from tokenizers import Tokenizer  # deferred: `dflash-trt --help` imports this module

        try:
            token_to_id = Tokenizer.from_file(str(folder / "tokenizer.json")).token_to_id
        except Exception as e:  # tokenizers raises a bare Exception for a malformed file
            raise CheckpointError(f"{folder / 'tokenizer.json'}: cannot load it ({e})") from None
    else:
        added = {_token_text(v): int(k) for k, v in (cfg.get("added_tokens_decoder") or {}).items()}
        token_to_id = added.get
    found = {t: token_to_id(t) for t in CHAT_END_TOKENS}
    return {t: i for t, i in found.items() if i is not None}, (token_to_id(eos) if eos else None)


def target_stop_ids(target) -> frozenset[int]:
    """The default stop ids of a target adapter: its `stop_ids` (TargetModel), else the rule over its
    configs alone (test doubles built without a model folder)."""
    ids = getattr(target, "stop_ids", None)
    if ids is not None:
        return frozenset(ids)
    hf = getattr(target, "hf", None)
    return model_stop_ids(getattr(target, "config", None), getattr(hf, "generation_config", None), None)
