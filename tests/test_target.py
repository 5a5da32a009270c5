"""Target adapter parity with Hugging Face's own forward, ragged batches and cache cropping."""

import pytest
import torch
from conftest import fp32_tol, tiny_hf

from dflash_trt.modeling.target import TargetModel


@pytest.mark.parametrize("fam", ["qwen3", "qwen2", "llama"])
def test_logits_and_taps_match_hf(fam):
    hf = tiny_hf(fam)
    t = TargetModel(hf)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
    cache = t.new_cache(2, 32)
    out = t.forward(ids[:, :7], cache, tap_layers=[1, 0])  # prefill then a 5-token "verify" chunk
    out2 = t.forward(ids[:, 7:], cache, tap_layers=[1, 0])
    logits = torch.cat([out.logits, out2.logits], 1)
    taps = torch.cat([out.taps, out2.taps], 1)
    torch.testing.assert_close(logits, ref.logits, **fp32_tol(ref.logits))
    # tap of layer i is transformers' hidden_states[i + 1] (before the final norm for the last layer)
    # taps come in the order asked for: layer 1 first (before the final norm), then layer 0
    torch.testing.assert_close(taps[..., 64:], ref.hidden_states[1], **fp32_tol(ref.hidden_states[1]))


def test_taps_are_hf_hidden_states_last_after_final_norm():
    """Tap i is transformers' hidden_states[i + 1], as the DFlash reference and vLLM read it: for the
    last layer that is after the final norm (the decoder layer's own output would differ)."""
    hf = tiny_hf("qwen3")
    t = TargetModel(hf)
    ids = torch.randint(0, 256, (1, 6))
    captured = {}
    h = hf.model.layers[1].register_forward_hook(
        lambda m, i, o: captured.setdefault("x", o[0] if isinstance(o, tuple) else o)
    )
    with torch.no_grad():
        hs = hf(ids, output_hidden_states=True).hidden_states
    h.remove()
    out = t.forward(ids, t.new_cache(1, 8), tap_layers=[1, 0])
    torch.testing.assert_close(out.taps, torch.cat([hs[2], hs[1]], -1), **fp32_tol(torch.cat([hs[2], hs[1]], -1)))
    assert not torch.allclose(out.taps[..., :64], captured["x"], atol=1e-3)  # pre-norm would be wrong


def test_ragged_prefill_equals_single_rows():
    t = TargetModel(tiny_hf("llama"))
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]
    cache = t.new_cache(3, 32)
    out = t.prefill(prompts, cache, tap_layers=[0, 1])
    assert cache.lengths.tolist() == [3, 7, 1]
    nxt = torch.tensor([[20], [21], [22]])
    step = t.forward(nxt, cache)
    for r, p in enumerate(prompts):
        c1 = t.new_cache(1, 32)
        o1 = t.prefill([p], c1, tap_layers=[0, 1])
        torch.testing.assert_close(out.logits[r], o1.logits[0], **fp32_tol(o1.logits[0]))
        torch.testing.assert_close(out.taps[r, : len(p)], o1.taps[0], **fp32_tol(o1.taps[0]))
        s1 = t.forward(nxt[r : r + 1], c1)
        torch.testing.assert_close(step.logits[r], s1.logits[0], **fp32_tol(s1.logits[0]))


def test_crop_then_rerun_equals_fresh():
    t = TargetModel(tiny_hf("qwen3"))
    ids = torch.randint(0, 256, (2, 10))
    cache = t.new_cache(2, 32)
    t.forward(ids[:, :6], cache)
    t.forward(torch.randint(0, 256, (2, 4)), cache)  # a block we then reject
    cache.crop(torch.tensor([6, 6]))
    again = t.forward(ids[:, 6:], cache)
    fresh = t.forward(ids, t.new_cache(2, 32))
    torch.testing.assert_close(again.logits, fresh.logits[:, 6:], **fp32_tol(fresh.logits[:, 6:]))


def test_cache_full_error():
    t = TargetModel(tiny_hf("qwen3"))
    cache = t.new_cache(1, 4)
    with pytest.raises(Exception, match="max_len"):
        t.forward(torch.zeros(1, 5, dtype=torch.long), cache)
