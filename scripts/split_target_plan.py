"""Memory per GPU and target FLOPs per token of `train --split-target` for a target's shapes, and
(--measure) the per-token cost of the target forward of the cached small models on this machine.

    python scripts/split_target_plan.py                      # the 8B and 70B plans of docs/training.md
    python scripts/split_target_plan.py --measure --out docs/train_runs/X.json

Memory of one rank (bf16 weights, 2 bytes): its decoder layers plus the embedding, final norm and
LM head every rank holds (train/split_target.py), the drafter with fp32 AdamW state (16 bytes per
parameter: weights, gradients, two moments), and the activations of one pipeline pass: a share of
batch x seq tokens through one layer at a time (inference mode: only the running hidden state, one
layer's attention/MLP temporaries and the K/V of the stage's layers) plus the tapped states kept.
FLOPs per token of the target forward: 2 x (parameters of the decoder layers, without the
embedding) + 4 x seq/2 x d x layers for causal attention (scores and values over on average half
the sequence). Measured (--measure): target_taps on the cached models, seconds per token, and the
ratio to the FLOP model's, interleaved so that the machine's other load hits both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import time

SHAPES = {  # Llama 3.1 8B / 70B (config.json), Qwen3-8B for comparison
    "llama-3.1-8b": dict(d=4096, layers=32, heads=32, kv=8, ffn=14336, vocab=128256),
    "qwen3-8b": dict(d=4096, layers=36, heads=32, kv=8, ffn=12288, vocab=151936),
    "llama-3.1-70b": dict(d=8192, layers=80, heads=64, kv=8, ffn=28672, vocab=128256),
}
GIB = 2**30


def layer_params(s: dict) -> int:
    head = s["d"] // s["heads"]
    attn = s["d"] * head * (s["heads"] * 2 + s["kv"] * 2)  # q, o, k, v
    return attn + 3 * s["d"] * s["ffn"] + 2 * s["d"]  # gate/up/down, two norms


def drafter_params(s: dict, drafter_layers: int = 1, taps: int = 5) -> int:
    """A DFlash drafter: its own decoder layers of the target's shape plus the fc from the taps;
    the embedding and LM head are the target's (shared, frozen)."""
    return drafter_layers * layer_params(s) + taps * s["d"] * s["d"] + s["d"]


def plan(name: str, ranks: int, share_seqs: int = 2, seq: int = 2048, taps: int = 5) -> dict:
    s = SHAPES[name]
    per_rank_layers = -(-s["layers"] // ranks)  # the largest stage
    shared = 2 * s["vocab"] * s["d"] + s["d"]  # embedding + LM head + final norm (untied)
    weights = (per_rank_layers * layer_params(s) + shared) * 2
    drafter = drafter_params(s, taps=taps) * 16
    tokens = share_seqs * seq
    head = s["d"] // s["heads"]
    kv = per_rank_layers * 2 * tokens * s["kv"] * head * 2  # the stage's K/V of one share (bf16)
    act = tokens * (4 * s["d"] + 2 * s["ffn"]) * 2 + share_seqs * s["heads"] * seq * 128 * 4  # + SDPA tiles
    tapped = max(ranks, 1) * tokens * taps * s["d"] * 2  # taps of every share pass through, kept until sent
    drafter_act = tokens * 40 * s["d"] * 4  # the drafter's step on its share, fp32 (rough: 40 d-vectors/token)
    total = weights + drafter + kv + act + tapped + drafter_act
    flops = 2 * s["layers"] * layer_params(s) + 4 * (seq / 2) * s["d"] * s["layers"]
    return {
        "target": name,
        "ranks": ranks,
        "layers_per_rank": per_rank_layers,
        "GiB": {
            "target_weights": round(weights / GIB, 1),
            "drafter_with_adamw": round(drafter / GIB, 1),
            "kv_and_activations": round((kv + act) / GIB, 1),
            "taps": round(tapped / GIB, 1),
            "drafter_activations": round(drafter_act / GIB, 1),
            "total": round(total / GIB, 1),
        },
        "target_gflop_per_token": round(flops / 1e9, 1),
    }


def measure(reps: int = 3) -> dict:
    import torch

    from dflash_trt.api import load_target
    from dflash_trt.train.features import target_taps

    torch.manual_seed(0)
    models = {}
    for name in ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"):
        t, _ = load_target(name, "float32", progress=False, for_training=True, device="cpu")
        c = t.config
        s = dict(d=c.hidden_size, layers=c.num_hidden_layers, heads=c.num_attention_heads)
        s.update(kv=c.num_key_value_heads, ffn=c.intermediate_size, vocab=c.vocab_size)
        models[name] = (t, s)
    seq, n = 512, 2
    ids = [torch.randint(0, 20000, (seq,)).tolist() for _ in range(n)]
    times = {k: [] for k in models}
    load = []
    for _ in range(reps):  # interleaved
        for k, (t, _) in models.items():
            load.append(os.getloadavg()[0])
            t0 = time.perf_counter()
            target_taps(t, ids, [1, t.num_layers - 1])
            times[k].append((time.perf_counter() - t0) / (n * seq))
    out = {"seq": seq, "rows": n, "reps": reps, "load_average_1min": [round(x, 1) for x in load]}
    for k, (_, s) in models.items():
        fl = 2 * s["layers"] * layer_params(s) + 4 * (seq / 2) * s["d"] * s["layers"]
        best = min(times[k])
        out[k] = {
            "s_per_token_best": best,
            "gflop_per_token": round(fl / 1e9, 3),
            "gflop_per_s": round(fl / best / 1e9, 1),
        }
    a, b = (out[k] for k in models)
    out["time_ratio_0.5b_over_135m"] = round(b["s_per_token_best"] / a["s_per_token_best"], 2)
    out["flop_ratio_0.5b_over_135m"] = round(b["gflop_per_token"] / a["gflop_per_token"], 2)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--measure", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    # ranks=1: the whole target on every rank (plain DDP, no split), what an 8B needs on 80 GB GPUs
    res = {"plans": [plan("llama-3.1-8b", 1), plan("llama-3.1-8b", 8), plan("qwen3-8b", 1), plan("llama-3.1-70b", 8)]}
    res["plans"].append(plan("llama-3.1-70b", 4))
    if a.measure:
        res["measured"] = measure()
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
