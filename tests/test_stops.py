"""TextStop (serving/stops.py) is incremental: equal, call for call, to the whole-output algorithm it
replaced (kept below as the reference) on randomized outputs of a real byte-level tokenizer (multi-byte
characters split across tokens, stops spanning token boundaries) and of a SentencePiece-style one; and
its decoding work per step is bounded, so a request's total work grows linearly with its output."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import tiny_tokenizer

from dflash_trt.serving.stops import TextStop, find_stop
from dflash_trt.serving.text import TextCodec

PIECES = [
    "漢字",
    "中文文本",
    "héllo",
    " wörld",
    "✓",
    "🙂",
    "😀👍",
    "The quick",
    " brown fox",
    "def add(a, b):",
    "\n",
    " ",
]


def reference_match(codec, stops, ids, start):
    """TextStop.match before it was incremental: decode the whole output, then every prefix."""
    if not stops or len(ids) <= start:
        return None
    if find_stop(codec.decode(ids), stops) is None:
        return None
    for k in range(max(start, 1), len(ids) + 1):
        if find_stop(codec.decode(ids[:k]), stops) is not None:
            return k
    return len(ids)


def sentencepiece_like():
    """A SentencePiece-style tokenizer (Metaspace, byte fallback, the leading space stripped on
    decode): a window of its ids decodes its first word without the space the full text has."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    text = ["The quick brown fox jumps over the lazy dog.", "héllo wörld ✓", "def add(a, b): return a + b"] * 20
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=400, special_tokens=specials))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module", params=["transformers", "light", "sentencepiece"])
def codec(request, tmp_path_factory):
    """The tiny byte-level BPE tokenizer of the serving tests, through both TextCodec backends, and a
    SentencePiece-style one."""
    if request.param == "sentencepiece":
        return TextCodec(sentencepiece_like())
    d = tmp_path_factory.mktemp("tok")
    tiny_tokenizer().save_pretrained(d)
    return TextCodec.from_dir(d, backend=request.param)


def _output(codec, rng, n: int) -> list[int]:
    if rng.random() < 0.3:  # any ids: lone UTF-8 bytes, skipped special tokens, U+FFFD everywhere
        return [int(i) for i in rng.integers(0, codec.vocab_size, n)]
    text = "".join(PIECES[int(i)] for i in rng.integers(0, len(PIECES), n))
    return codec.encode(text, chat=False)[:n]


def _stops(codec, rng, ids) -> list[str]:
    text = codec.decode(ids)
    stops = []
    for _ in range(int(rng.integers(1, 4))):
        if rng.random() < 0.15 or len(text) < 2:
            stops.append("never-here")
            continue
        n = int(rng.integers(1, 7))
        pos = int(rng.integers(0, max(1, len(text) - n)))
        stops.append(text[pos : pos + n])
    return stops


def test_match_equals_the_whole_output_algorithm_step_by_step(codec):
    rng = np.random.default_rng(0)
    matched = 0
    for _ in range(150):
        ids = _output(codec, rng, int(rng.integers(5, 60)))
        # the stop strings come from the output's text, but often start later than their first
        # occurrence's token boundary: they span tokens and split multi-byte characters' tokens
        stop = TextStop(codec, _stops(codec, rng, ids))
        start = 0
        while start < len(ids):
            end = min(len(ids), start + int(rng.integers(1, 9)))  # a verify step's accepted tokens
            got, want = stop.match(ids[:end], start), reference_match(codec, stop.stops, ids[:end], start)
            assert got == want, (ids[:end], start, stop.stops)
            if got is not None:
                matched += 1
                break
            start = end
    assert matched > 50  # most outputs do hit a stop: the search, not only the no-match path, is compared


class _Counting:
    """A codec whose decode counts the ids it is given."""

    def __init__(self, codec):
        self.codec, self.decoded = codec, 0

    def decode(self, ids):
        self.decoded += len(ids)
        return self.codec.decode(ids)


def _decoded_over_a_stream(codec, n: int) -> int:
    rng = np.random.default_rng(1)
    text = "".join(PIECES[int(i)] for i in rng.integers(0, len(PIECES), 4 * n))
    ids = codec.encode(text, chat=False)[:n]
    assert len(ids) == n
    counting = _Counting(codec)
    stop = TextStop(counting, ["NEVER!", "字 x🙂"])
    start = 0
    while start < n:
        end = min(n, start + int(rng.integers(1, 9)))
        assert stop.match(ids[:end], start) is None
        start = end
    return counting.decoded


def test_decoding_work_per_step_is_bounded(codec):
    """Over a 2000-token output with stops that never match, the ids decoded grow linearly: twice the
    output, about twice the work (the whole-output algorithm decodes ~n^2 / 9 ids here: ~440k)."""
    small, large = _decoded_over_a_stream(codec, 1000), _decoded_over_a_stream(codec, 2000)
    assert large < 2.3 * small
    assert large < 50 * 2000
