"""Helpers shared by the training test modules: a tiny target's greedy corpus written as a data shard."""

import json

import torch

from dflash_trt.config import SamplingParams
from dflash_trt.decoding.loop import generate_baseline
from dflash_trt.modeling.drafter import DFlashDrafter


def corpus(t, n, seed, V, max_new=48):
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(0, V, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]
    outs = generate_baseline(t, prompts, SamplingParams(max_new_tokens=max_new, ignore_eos=True)).tokens
    return prompts, outs


def write_corpus(folder, prompts, outs):
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "data-00000.jsonl", "w") as f:
        for p, o in zip(prompts, outs):
            f.write(json.dumps({"input_ids": p + o, "prompt_len": len(p)}) + "\n")
    return folder


def drafter_weights(folder):
    return DFlashDrafter.from_pretrained(folder).state_dict()
