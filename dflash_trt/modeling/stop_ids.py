"""The model's default stop ids: what ends generation unless a request sets ignore_eos, read from the
model's configs and its tokenizer files.

Boundary: config objects and a model folder in, token ids out; no tensors, no transformers import. The
one home of the rule (`model_stop_ids`): the target adapter computes its ids at load (modeling/target.py
`stop_ids`, with `tokenizer_stops` reading the folder), decoding/stopping.py's StopRule applies them and
api.stop_ids(tokenizer) is the same rule over a loaded tokenizer. It sits in modeling/, below decoding/,
because the target adapter needs it at load and modeling must not import decoding.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from dflash_trt.errors import CheckpointError

# what instruct models write at the end of a turn (ChatML, Qwen/SmolLM base, Llama 3): often not the
# tokenizer's or the config's eos_token, so a chat reply would run on into a next invented turn
CHAT_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>")


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
