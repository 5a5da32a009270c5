"""Shared fixtures: tiny random targets (Qwen3, Qwen2, Llama) and drafters, seeded."""

from __future__ import annotations

import math
import os

import pytest
import torch

from dflash_trt.config import DrafterConfig
from dflash_trt.modeling.cache import KVCache
from dflash_trt.modeling.drafter import DFlashDrafter
from dflash_trt.modeling.target import TargetModel


def pytest_collection_modifyitems(config, items):
    """The one place `gpu` tests are skipped: where PyTorch sees no CUDA device (so `-m gpu -rs` on a
    CPU machine lists them with this reason instead of failing them)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(
        reason=f"gpu: needs a CUDA device; torch {torch.__version__} sees none here "
        f"(run on a GPU machine, e.g. bash scripts/gpu_check.sh)"
    )
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_torch_thread():
    """In-process baselines with one intra-op thread: on a shared 2-core host, OpenMP barriers
    over 2 threads run tiny models ~50x slower. Restored afterwards. A module opts in with
    `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=256,
    max_position_embeddings=512,
)


EPS32 = torch.finfo(torch.float32).eps
# the longest reduction in the tiny models: the MLP's down projection sums intermediate_size products
TINY_K = TINY["intermediate_size"]


def fp32_tol(expected: torch.Tensor, k: int = TINY_K, c: float = 8.0) -> dict:
    """atol / rtol for two fp32 computations of the same values that may sum in different orders: a batch
    vs one row, a cropped-and-rerun cache vs a fresh one, a reference implementation, or another CPU's
    GEMM kernels (AVX2 and AVX-512 block their sums differently, so Intel and AMD machines disagree in
    the last bits). A reordered sum of k terms moves by rounding errors of about eps * sqrt(k) times the
    terms' size (they accumulate as a random walk; eps * k is a worst case blocked sums never approach);
    c covers a few chained reductions (attention, then projections, over two layers) and the tail over
    every element compared. The scale is the expected values' largest magnitude, at least 1 (activations
    are normalised; values near 0 carry the error of the sums that produced them, not their own size)."""
    rel = c * EPS32 * math.sqrt(k)
    scale = max(1.0, float(expected.detach().abs().max())) if expected.numel() else 1.0
    return {"atol": rel * scale, "rtol": rel}


def tiny_config(family: str = "qwen3", **over):
    """The HF config of a tiny `family` model (TINY, head_dim 16 for Qwen3); `over` replaces or adds
    fields (a reference drafter's config is a Qwen3 one with its own fields added)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    kw = {**TINY, **over}
    if family == "qwen3":
        return Qwen3Config(**{"head_dim": 16, **kw})
    if family == "qwen2":
        return Qwen2Config(**kw)
    if family == "llama":
        return LlamaConfig(**kw)
    raise ValueError(family)


def tiny_hf(family: str = "qwen3", seed: int = 0, **over):
    """A tiny random HF causal LM (fp32, eval), weights seeded; no eos token."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(family, **over)
    cfg.eos_token_id = None  # random models: no accidental early stop
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).float().eval()


def tiny_target(family: str = "qwen3", seed: int = 0, **over) -> TargetModel:
    return TargetModel(tiny_hf(family, seed, **over))


def tiny_drafter(
    target: TargetModel, block_size: int = 4, num_layers: int = 2, seed: int = 1, scale: float = 1.0
) -> DFlashDrafter:
    cfg = DrafterConfig.for_target(target.config, num_layers=num_layers, block_size=block_size)
    torch.manual_seed(seed)
    d = DFlashDrafter(cfg)
    with torch.no_grad():  # larger random weights than the default init: a less uniform drafter
        for p in d.parameters():
            if p.dim() == 2:
                p.normal_(0, scale * p.shape[1] ** -0.5)
    return d.float().bind(target)


class _RowsCache:
    """Cache stand-in for OracleDrafter: per-row lengths and the row's reference sequence."""

    def __init__(self, seqs, max_len):
        self.seqs, self.max_len = list(seqs), max_len
        self.lengths = torch.zeros(len(seqs), dtype=torch.long)

    def check_room(self, n):
        pass

    def crop(self, lengths):
        self.lengths = lengths.clone()

    def select_rows(self, rows):
        self.seqs = [self.seqs[i] for i in rows.tolist()]
        self.lengths = self.lengths[rows]

    def extend(self, other):
        self.seqs += other.seqs
        self.lengths = torch.cat([self.lengths, other.lengths])


class OracleDrafter:
    """Test double: proposes the target's own greedy continuation (from a reference run), so
    every draft must be accepted. Rows are bound to sequences in the order caches are made."""

    def __init__(self, target, sequences, block_size):
        self.target, self.block_size, self.mask_token_id = target, block_size, 0
        self.target_layer_ids = [0]
        self._queue = list(sequences)  # prompt + greedy output, one per prompt, in add order

    def new_cache(self, batch, max_len):
        seqs, self._queue = self._queue[:batch], self._queue[batch:]
        return _RowsCache(seqs, max_len)

    def inject_context(self, taps, num_new, cache):
        cache.lengths = cache.lengths + num_new

    def draft_logits(self, block_ids, cache):
        R, B = block_ids.shape
        logits = torch.zeros(R, B - 1, self.target.vocab_size)
        for r in range(R):
            start, seq = int(cache.lengths[r]), cache.seqs[r]
            for i in range(1, B):
                pos = start + i
                logits[r, i - 1, seq[pos] if pos < len(seq) else 0] = 1.0
        return logits


@pytest.fixture(params=["qwen3", "llama"])
def family(request):
    return request.param


def fresh_cache_like(c: KVCache) -> KVCache:
    return KVCache(len(c.k), c.batch, c.k[0].shape[1], c.k[0].shape[3], c.max_len, c.k[0].dtype)


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer():
    """A real byte-level BPE tokenizer built offline (vocab ~300) with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = [
        "def add(a, b):\n    return a + b\n",
        "The quick brown fox jumps over the lazy dog.",
        "Speculative decoding drafts tokens and verifies them.",
        "héllo wörld ünïcode ✓ 漢字",
    ] * 20
    tok.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_model_dir(folder, family: str = "qwen3", seed: int = 0):
    """A saved tiny random target with a real tokenizer: what `--target DIR` expects."""
    tok = tiny_tokenizer()
    hf = tiny_hf(family, seed, vocab_size=len(tok))
    hf.config.eos_token_id = tok.eos_token_id
    hf.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def tiny_pair_dir(root, block_size: int = 4) -> TargetModel:
    """root/target (tiny_model_dir) and root/drafter (a tiny_drafter for it, saved); the target, loaded back."""
    tiny_model_dir(root / "target")
    target = TargetModel.from_pretrained(root / "target", dtype=torch.float32)
    tiny_drafter(target, block_size=block_size).save_pretrained(root / "drafter")
    return target


def processes_mentioning(text: str) -> list[int]:
    """pids whose command line contains `text` (a server's repository path: its tritonserver and stubs)."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        pids.append(int(d))
            except OSError:
                pass
    return pids
