"""The request inputs TensorRT-LLM's Triton backend (tensorrtllm_backend) clients send beyond the
core ones: each is accepted and applied, or refused in one line naming it; none is ignored where it
would change the output.

Boundary: parsing only (numpy getters as in serving/protocol.py, no Triton). Names, types and
shapes follow tensorrtllm_backend's all_models/inflight_batcher_llm/{ensemble,tensorrt_llm_bls}/
config.pbtxt and its own model_config docs (INT32 / FP32 / BOOL / STRING, dims [1], bad_words [-1]):

  repetition_penalty, presence_penalty, frequency_penalty   -> SamplingParams (1.0 / 0 / 0 = off)
  min_tokens (docs) or min_length (the ensemble's name)      -> SamplingParams.min_tokens
  bad_words (text models; STRING)                            -> token ids, SamplingParams.bad_words_ids
  bad_words_ids (the engine model; INT32, -1 separated)      -> SamplingParams.bad_words_ids
  pad_id                                                     accepted; padding never shows in a text output
  return_num_input_tokens, return_num_output_tokens         accepted; num_input_tokens / num_output_tokens
                                                             are always returned
  beam_width > 1, num_return_sequences > 1, return_log_probs true   refused (one sampled sequence,
                                                             no log probabilities)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from dflash_trt.serving.text import join_stop_sequences

# name -> Triton type, for the text front doors and the ensemble (the engine model takes bad_words_ids instead)
TRTLLM_INPUTS = {
    "repetition_penalty": "TYPE_FP32",
    "presence_penalty": "TYPE_FP32",
    "frequency_penalty": "TYPE_FP32",
    "min_tokens": "TYPE_INT32",
    "min_length": "TYPE_INT32",
    "bad_words": "TYPE_STRING",
    "pad_id": "TYPE_INT32",
    "beam_width": "TYPE_INT32",
    "num_return_sequences": "TYPE_INT32",
    "return_log_probs": "TYPE_BOOL",
    "return_num_input_tokens": "TYPE_BOOL",
    "return_num_output_tokens": "TYPE_BOOL",
}
# what the text front doors (and DFlashClient) send the engine model as they are, with their tensor dtypes
ENGINE_FORWARDED = {
    "repetition_penalty": np.float32,
    "presence_penalty": np.float32,
    "frequency_penalty": np.float32,
    "min_tokens": np.int32,
}


def logit_controls(get: Callable, one: Callable, error: type[Exception]) -> dict:
    """SamplingParams keywords from the request (only those it sets), after refusing what this server
    cannot do. `one(get, name)` reads a single value (or None); `error` is the RequestError type."""
    for name, what in (("beam_width", "beam search"), ("num_return_sequences", "several sequences per request")):
        v = one(get, name)
        if v is not None and int(v) != 1:
            raise error(
                f"{name}={int(v)}: {what} is not supported (speculative decoding returns one sampled "
                f"sequence); send 1 or leave it out"
            )
    v = one(get, "return_log_probs")
    if v is not None and bool(v):
        raise error("return_log_probs: log probabilities are not returned by this server; send false or leave it out")
    out = {}
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        v = one(get, name)
        if v is not None:
            out[name] = float(v)
    a, b = one(get, "min_tokens"), one(get, "min_length")
    if a is not None and b is not None and int(a) != int(b):
        raise error(f"min_tokens={int(a)}, min_length={int(b)}: the same setting twice; send one of them")
    if a is not None or b is not None:
        out["min_tokens"] = int(a if a is not None else b)
    return out


def bad_word_variants(words: Sequence[str]) -> list[str]:
    """Each bad word as written, and with a leading space unless it has one (vLLM's rule): a word the
    model writes after a space is a different token sequence."""
    out: list[str] = []
    for w in words:
        for v in (w, w if w.startswith(" ") else " " + w):
            if w and v not in out:
                out.append(v)
    return out


def flatten_words(words: Sequence[Sequence[int]]) -> np.ndarray:
    """[[a, b], [c]] -> INT32 [1, N] with -1 separators (text.join_stop_sequences; an empty list travels
    as [[-1]])."""
    return np.array([join_stop_sequences(words) or [-1]], np.int32)
