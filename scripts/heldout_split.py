"""Write a validation prompt file from a held-out benchmark set, disjoint from the prompts that
`dflash-trt eval --limit N` (and `bench -n N`) measure on, so that watching validation metrics while
training never tunes on the final measurement.

    python scripts/heldout_split.py --dataset humaneval --eval-limit 16 --num 32 --out val_prompts.jsonl
    dflash-trt data generate --target T --prompts val_prompts.jsonl --validation --out val/
"""

from __future__ import annotations

import argparse
import json

from dflash_trt.bench.datasets import spread
from dflash_trt.train.prompts import load_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="humaneval", help="humaneval | writingbench")
    ap.add_argument("--eval-limit", type=int, default=16, help="the --limit of the eval this must not overlap")
    ap.add_argument("--num", type=int, default=32, help="validation prompts to write")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    measured = set(load_prompts(a.dataset, a.eval_limit))
    rest = [p for p in load_prompts(a.dataset) if p not in measured]
    chosen = spread(rest, a.num)
    with open(a.out, "w") as f:
        for p in chosen:
            f.write(json.dumps({"prompt": p}) + "\n")
    print(
        f"{a.out}: {len(chosen)} {a.dataset} prompts, none among the {len(measured)} that eval --limit "
        f"{a.eval_limit} uses"
    )


if __name__ == "__main__":
    main()
