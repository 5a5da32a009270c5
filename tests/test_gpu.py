"""What only a CUDA device can check: device choice with a real GPU present, and greedy DFlash on CUDA
tensors (the PyTorch path) equal to plain decoding on the same device.

Every test here is marked `gpu`; tests/conftest.py skips them where PyTorch sees no CUDA device.
The Triton kernels on a GPU are tests/test_kernels.py's job (DFLASH_TEST_KERNELS_ON_GPU=1, also
marked `gpu` then): this file keeps kernels="torch" because other test modules switch Triton to its
CPU interpreter for the whole session.
"""

import pytest
import torch
from conftest import tiny_drafter, tiny_hf

from dflash_trt.api import parse_dtype, resolve_device
from dflash_trt.config import SamplingParams
from dflash_trt.decoding.loop import generate, generate_baseline
from dflash_trt.modeling.target import TargetModel

pytestmark = pytest.mark.gpu

PROMPTS = [[3, 17, 42, 9, 5], [11, 2, 8], [200, 100, 50, 25, 12, 6]]
BLOCK = 4


@pytest.fixture(scope="module")
def target():
    return TargetModel(tiny_hf("qwen3").to("cuda"))


def test_auto_device_and_dtype_pick_the_gpu():
    assert resolve_device("auto").type == "cuda"
    assert parse_dtype("auto") == torch.bfloat16  # generation on CUDA runs bf16 ...
    assert parse_dtype("auto", device="cpu") == torch.float32  # ... the CPU keeps fp32


def test_greedy_dflash_on_cuda_equals_baseline(target):
    params = SamplingParams(max_new_tokens=16)
    base = generate_baseline(target, PROMPTS, params)
    out = generate(target, tiny_drafter(target, block_size=BLOCK), PROMPTS, params, kernels="torch", cuda_graph="off")
    assert target.device.type == "cuda"
    assert out.tokens == base.tokens and all(len(t) == 16 for t in out.tokens)
    s = out.stats
    assert s.num_verify_steps > 0 and 1.0 <= s.tau <= BLOCK
