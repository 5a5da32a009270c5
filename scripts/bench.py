#!/usr/bin/env python3
"""Run the DFlash benchmark without the `dflash-trt` entry point: the same command (and library
call, `dflash_trt.bench.run_bench`) as `dflash-trt bench`.

    python scripts/bench.py --target qwen2.5-coder-1.5b-instruct --drafter DIR \
        --assistant qwen2.5-coder-0.5b-instruct --dataset humaneval --dataset writingbench -n 8
"""

from dflash_trt.bench.cli import bench

if __name__ == "__main__":
    bench(prog_name="scripts/bench.py")
