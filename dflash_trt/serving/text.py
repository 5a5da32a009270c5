"""Text <-> token ids for the serving models: prompt encoding (optional chat template) and
detokenisation whose streamed pieces concatenate to exactly the non-streamed text.

Boundary: pure Python over a Hugging Face tokenizer; no Triton, no torch. Used in-process by the
`dflash_bls` / `dflash_unary` models and by `preprocessing` / `postprocessing`, and by tests to
compute the expected text.

Streaming rule. Let decode(ids) be the full decode (special tokens skipped, no clean-up of
spaces, so it is a pure function of the ids). While a request runs, the text released so far is
`stable(ids) = decode(ids)` without its trailing U+FFFD characters: a trailing replacement
character may be a multi-byte UTF-8 character split across tokens that the next token completes,
so it is held back. The final response releases decode(ids) in full (an invalid byte the model
really produced stays U+FFFD, as in the non-streamed text). Each chunk is the difference between
consecutive released texts, so the chunks concatenate to decode(all ids) exactly for any decoder
whose stable text only grows (byte-level BPE, SentencePiece with byte fallback).
`text_delta()` computes a chunk statelessly from the cumulative ids (the ensemble's
postprocessing); `StreamDetokenizer` does the same with the released text kept in memory. With
stop strings (serving/stops.py) the released text is also cut before the first stop string and,
until the final response, holds back a tail that may be the start of one: it still only grows.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path

from dflash_trt.errors import CheckpointError, DFlashError
from dflash_trt.serving.stops import REPLACEMENT, clean_stops, cut


class TextCodec:
    """A tokenizer loaded from a folder (AutoTokenizer), with the serving conventions applied."""

    def __init__(self, tokenizer, default_chat_template: bool = False):
        self.tok = tokenizer
        self.default_chat_template = default_chat_template

    @classmethod
    def from_dir(cls, path: str | Path, default_chat_template: bool = False, backend: str = "auto") -> TextCodec:
        """backend "auto": the light tokenizers+jinja2 loader when tokenizer.json exists (0.2 s,
        no torch import: matters with one tokenizer per Triton model process), else AutoTokenizer."""
        path = Path(path)
        if not path.is_dir():
            raise CheckpointError(
                f"tokenizer_dir {path}: not a folder; expected tokenizer.json or " f"tokenizer_config.json"
            )
        if backend == "auto":
            backend = "light" if (path / "tokenizer.json").is_file() else "transformers"
        try:
            if backend == "light":
                return cls(LightTokenizer(path), default_chat_template)
            from transformers import AutoTokenizer  # deferred: ~0.6 s to import, and torch with it

            return cls(AutoTokenizer.from_pretrained(str(path)), default_chat_template)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"tokenizer_dir {path}: cannot load a tokenizer ({type(e).__name__}: {e})") from None

    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    @property
    def eos_token_id(self) -> int | None:
        return self.tok.eos_token_id

    @functools.cached_property
    def max_token_chars(self) -> int:
        """An upper bound on the input characters one token covers, so a text longer than n times this
        holds more than n tokens without being tokenized: the longest vocabulary string (a byte-level
        BPE string has one character per byte, so at least as many as it decodes to), times 4 for a
        normalizer's composition (NFC merges a letter and up to three combining marks into one)."""
        vocab = self.tok.backend.get_vocab(with_added_tokens=True) if self.light else self.tok.get_vocab()
        return 4 * max(map(len, vocab), default=1)

    @property
    def light(self) -> bool:
        return isinstance(self.tok, LightTokenizer)

    def encode(self, text: str, chat: bool | None = None) -> list[int]:
        """Prompt ids; chat=True wraps text as one user message with the generation prompt."""
        chat = self.default_chat_template if chat is None else chat
        if chat:
            if not getattr(self.tok, "chat_template", None):
                raise DFlashError("apply_chat_template: the tokenizer in tokenizer_dir has no chat template")
            rendered = self.tok.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
            return list(self.tok(rendered, add_special_tokens=False)["input_ids"])
        return list(self.tok(text, add_special_tokens=True)["input_ids"])

    def encode_stop_words(self, words: Sequence[str]) -> list[list[int]]:
        """Each stop word as the token sequence it encodes to on its own (no special tokens)."""
        out = []
        for w in words:
            if w:
                ids = list(self.tok(w, add_special_tokens=False)["input_ids"])
                if ids:
                    out.append(ids)
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def stable(self, ids: Sequence[int]) -> str:
        """Text that later tokens cannot change: decode(ids) without trailing U+FFFD."""
        return self.decode(ids).rstrip(REPLACEMENT)


def _token_text(v) -> str | None:
    return v.get("content") if isinstance(v, dict) else v


def read_chat_template(path: Path, tokenizer_config: dict | None = None) -> str | None:
    """The chat template a Hugging Face tokenizer folder carries (tokenizer_config.json's
    `chat_template`, its "default" entry when named, else chat_template.jinja), or None."""
    if tokenizer_config is None:
        cfg_file = path / "tokenizer_config.json"
        try:
            tokenizer_config = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        except ValueError:
            tokenizer_config = {}
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: use the default one
        template = {t.get("name"): t.get("template") for t in template}.get("default")
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    return template


class LightTokenizer:
    """The parts of a Hugging Face fast tokenizer serving needs, from tokenizer.json and
    tokenizer_config.json alone: encode (special tokens per the saved post-processor, plus BOS/EOS
    when add_bos_token/add_eos_token ask for them), decode, and the Jinja chat template rendered as
    transformers renders it (sandboxed, trim_blocks, lstrip_blocks, loopcontrols)."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer  # deferred, as jinja2 below: `dflash-trt --help` imports this module

        self.backend = Tokenizer.from_file(str(path / "tokenizer.json"))
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        self.chat_template = read_chat_template(path, cfg)
        self.special = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        self.eos_token_id = self.backend.token_to_id(self.special["eos_token"]) if self.special["eos_token"] else None
        bos = self.special["bos_token"]
        self._bos = self.backend.token_to_id(bos) if bos and cfg.get("add_bos_token") else None
        eos = self.special["eos_token"]
        self._eos = self.backend.token_to_id(eos) if eos and cfg.get("add_eos_token") else None

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._bos is not None and ids[:1] != [self._bos]:
            ids = [self._bos] + ids
        if add_special_tokens and self._eos is not None and ids[-1:] != [self._eos]:
            ids = ids + [self._eos]
        return {"input_ids": ids}

    def decode(self, ids, skip_special_tokens: bool = True, clean_up_tokenization_spaces: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def _template(self):
        """The chat template compiled once (it is fixed at load; every chat request renders it)."""
        from jinja2.ext import loopcontrols  # deferred: ~20 ms with tokenizers, paid only where a template renders
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise DFlashError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **kw: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii
        )
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template)

    def apply_chat_template(self, messages, tokenize: bool = False, add_generation_prompt: bool = True) -> str:
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            **{k: v for k, v in self.special.items() if v is not None},
        )


def released_text(codec: TextCodec, ids: Sequence[int], final: bool, stops: Sequence[str] = (), start: int = 0):
    """(text a client may have seen after these ids, whether a stop string ended it). Stop strings
    are searched from character `start` on (the echoed prompt's text is not searched)."""
    now = codec.decode(ids) if final else codec.stable(ids)
    return cut(now, stops, final, start)


def text_delta(
    codec: TextCodec, ids: Sequence[int], num_prev: int, final: bool, stops: Sequence[str] = (), num_prompt: int = 0
) -> str:
    """The chunk for a response holding all `ids` so far, `num_prev` of which earlier responses
    covered. Stateless: recomputes what was released before from ids[:num_prev]. With stop
    strings, ids[:num_prompt] (an echoed prompt) are not searched for them."""
    start = len(codec.stable(ids[:num_prompt])) if stops and num_prompt else 0
    before = released_text(codec, ids[:num_prev], False, stops, start)[0] if num_prev else ""
    now, stopped = released_text(codec, ids, final, stops, start)
    final = final or stopped
    return now[len(before) :] if now.startswith(before) else (now[len(before) :] if final else "")


class StreamDetokenizer:
    """Stateful per-request version of text_delta: feed new ids, get the text chunk to send.
    After `watch(stops)`, text from then on is cut at the first stop string (`stopped` turns
    True) and, until the final chunk, the possible start of a stop string is held back."""

    def __init__(self, codec: TextCodec):
        self.codec = codec
        self.ids: list[int] = []
        self.released = ""
        self.stops: tuple[str, ...] = ()
        self.start = 0
        self.stopped = False

    def watch(self, stops: Sequence[str]) -> None:
        """Search the text released from now on (not an echoed prompt before) for these stops."""
        self.stops, self.start = clean_stops(stops), len(self.released)

    def add(self, new_ids: Sequence[int], final: bool = False) -> str:
        if self.stopped:
            return ""
        self.ids.extend(int(t) for t in new_ids)
        now, self.stopped = released_text(self.codec, self.ids, final, self.stops, self.start)
        if not now.startswith(self.released):  # a decoder whose stable text shrank: wait for the end
            if not (final or self.stopped):
                return ""
        delta = now[len(self.released) :]
        self.released = now
        return delta


def split_stop_sequences(flat: Sequence[int]) -> list[list[int]]:
    """Stop sequences travel flattened with -1 separators: [a, b, -1, c] -> [[a, b], [c]]."""
    seqs, cur = [], []
    for t in flat:
        t = int(t)
        if t < 0:
            if cur:
                seqs.append(cur)
            cur = []
        else:
            cur.append(t)
    if cur:
        seqs.append(cur)
    return seqs


def join_stop_sequences(seqs: Sequence[Sequence[int]]) -> list[int]:
    flat: list[int] = []
    for s in seqs:
        if flat:
            flat.append(-1)
        flat.extend(int(t) for t in s)
    return flat
