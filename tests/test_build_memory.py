"""The target's quantization never holds the whole target: peak memory is bounded by its largest layer.

A shaped target (scripts/shaped_target.py: random bf16 weights, decoder layers the largest modules as in an
8B model) is quantized to FP8 with an FP8 KV cache by deploy/modelopt_target.py in a fresh process, which
reports how far its resident set grew above what it held after importing everything.

Why not tracemalloc: it sees only Python's own allocator (PyMem), while torch allocates tensor storage
through c10's CPU allocator (posix_memalign / mmap), so a whole bf16 model would never show up there; torch's
own accounting (memory_stats, max_memory_allocated) exists for CUDA only. What is measured is the process's
anonymous resident memory (RssAnon in /proc/self/status, sampled every 10 ms by a thread: every tensor the
process allocates, nothing else), as growth over what it held after importing everything, with glibc's mmap
threshold fixed so freed tensors leave the resident set (55 MiB peak growth against 174 MiB with the
default dynamic threshold, here: the default keeps freed layer-sized blocks in the heap). File-backed pages
of the memory-mapped checkpoint (RssFile) are left out: they are page cache the kernel drops under pressure
(VmHWM counts them, and reads ~150 MB more here for a 300 MB checkpoint). The bound: the resident embeddings +
LM head (small here), one layer being calibrated or exported, and one export shard buffer, taken as 4 largest
layers plus the shard; the whole checkpoint is well above it, so holding it would fail the test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import shaped_target  # noqa: E402  (scripts/ is not a package)

# 8 layers of 40 MB, 8 MB embeddings: a ~340 MB checkpoint whose largest module is a decoder layer
SHAPE = {**shaped_target.SMALL, "hidden_size": 1024, "intermediate_size": 5120, "num_hidden_layers": 8}
SHAPE.update(vocab_size=4096)
SHARD = 32 * 2**20

CHILD = r"""
import json, sys, threading
from pathlib import Path
import modelopt.torch.quantization, modelopt.torch.export, transformers, accelerate  # imported before the baseline
from dflash_trt.deploy.modelopt_target import quantize_target

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024

src, dst, shard = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
base, peak, done = anon(), [0], threading.Event()

def sample():
    while not done.wait(0.01):
        peak[0] = max(peak[0], anon())

t = threading.Thread(target=sample)
t.start()
try:
    info = quantize_target(src, dst, "fp8", "fp8", [list(range(3, 19))], echo=lambda _: None, shard_size=shard)
finally:
    done.set()
    t.join()
print(json.dumps({"peak_growth": max(peak[0], anon()) - base, "info": info}))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc (RssAnon)")
def test_quantizing_a_target_stays_within_a_few_layers_of_memory(tmp_path):
    pytest.importorskip("modelopt")
    tok = tiny_tokenizer()
    tok.save_pretrained(tmp_path / "tok")
    shaped_target.make(tmp_path / "target", SHAPE, tmp_path / "tok", shard_gb=0.1)
    layer = shaped_target.largest_layer_bytes(SHAPE)
    total = sum(f.stat().st_size for f in (tmp_path / "target").glob("*.safetensors"))
    bound = 4 * layer + SHARD
    assert total > 1.6 * bound  # the test could fail: the whole model does not fit in the bound
    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "target"), str(tmp_path / "q"), str(SHARD)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
        # a fixed mmap threshold: glibc otherwise raises it (up to 32 MB) after each large free, so freed
        # layer-sized buffers stay in the heap and count as resident; fixed, every tensor-sized block is its
        # own mapping, returned on free, and RssAnon follows the tensors alive
        env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["info"]["format"] == "FP8" and out["info"]["kv_scales"] == 2 * SHAPE["num_hidden_layers"]
    assert out["peak_growth"] < bound, (out["peak_growth"] / 2**20, layer / 2**20, total / 2**20)
