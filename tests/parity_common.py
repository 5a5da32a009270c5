"""Shared by the reference parity tests (tests/test_reference_parity*.py): the authors' DFlash package
(skips the importing module where it is not installed), the tiny shapes, and the helpers that train a
drafter until it accepts and compare a whole generation with the reference's dflash_generate.
"""

from __future__ import annotations

import json

import pytest
import torch

from dflash_trt.config import SamplingParams
from dflash_trt.decoding.engine import SpecEngine
from dflash_trt.train.objective import dflash_loss, make_blocks, sample_anchors

ref = pytest.importorskip(
    "dflash.model", reason="the DFlash reference is not installed (.venv/bin/pip install --no-deps dflash==0.1.0)"
)

L = 4  # target layers: taps can include the last one (L-1), read after the final norm
MASK = 255


def train_until_it_accepts(drafter, target, prompts, steps: int):
    """A few hundred tiny steps on the target's own greedy continuations of `prompts`."""
    with torch.no_grad():
        seqs = [p + greedy(target, p, 24) for p in prompts]
    ids = torch.tensor(seqs)
    no_logits = torch.zeros(len(seqs), 0, dtype=torch.long)
    taps = target.forward(
        ids, target.new_cache(len(seqs), ids.shape[1]), drafter.target_layer_ids, logits_at=no_logits
    ).taps
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    drafter.train()
    for _ in range(steps):
        anchors, valid = sample_anchors(
            [ids.shape[1]] * len(seqs), [len(prompts[0])] * len(seqs), 8, drafter.block_size, g
        )
        out = dflash_loss(drafter, taps, make_blocks(ids, anchors, valid, drafter.block_size, MASK), 2.0)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    return drafter.eval()


def greedy(target, prompt, n):
    cache = target.new_cache(1, len(prompt) + n + 1)
    out = target.prefill([prompt], cache)
    toks = [int(out.logits[0, -1].argmax())]
    while len(toks) < n:
        toks.append(int(target.forward(torch.tensor([[toks[-1]]]), cache).logits[0, -1].argmax()))
    return toks


def our_generate(target, drafter, prompt, n):
    """-> (generated tokens, tokens per verify step) from SpecEngine on the PyTorch path."""
    eng = SpecEngine(target, drafter, max_batch=1, max_seq_len=len(prompt) + n + 1, kernels="torch")
    eng.add_request("0", prompt, SamplingParams(max_new_tokens=n))
    tokens, per_step = [], []
    while eng.has_unfinished():
        for out in eng.step():
            per_step.append(len(out.new_token_ids) - (1 if not tokens else 0))  # the first holds prefill's token
            tokens += out.new_token_ids
    return tokens, per_step


def edit_config(folder, **changes):
    """Set config.json keys of a checkpoint folder ('outer.inner' reaches into a nested dict)."""
    cfg = json.loads((folder / "config.json").read_text())
    for k, v in changes.items():
        if "." in k:
            outer, inner = k.split(".")
            cfg[outer][inner] = v
        else:
            cfg[k] = v
    (folder / "config.json").write_text(json.dumps(cfg))


def generation_matches_reference(hf, target, ours, theirs, prompt: list[int], n: int) -> list[int]:
    """Greedy generation of `n` tokens by dflash-trt's engine and by the reference's dflash_generate:
    the same tokens, and the same tokens per verify step over the full blocks (the reference drafts
    a shorter block once fewer than B tokens remain). -> the reference's acceptance lengths.
    Callers monkeypatch ref._cuda_time to time.perf_counter: return_stats synchronises CUDA otherwise."""
    res = ref.dflash_generate(
        theirs, hf, torch.tensor([prompt]), max_new_tokens=n, stop_token_ids=None, return_stats=True
    )
    tokens, per_step = our_generate(target, ours, prompt, n)
    assert tokens == res.output_ids[0, len(prompt) :].tolist()
    full, pos = 0, len(prompt)
    for k in res.acceptance_lengths:
        if pos + ours.block_size > len(prompt) + n:
            break
        full, pos = full + 1, pos + k
    assert per_step[:full] == res.acceptance_lengths[:full], (per_step, res.acceptance_lengths)
    return res.acceptance_lengths
