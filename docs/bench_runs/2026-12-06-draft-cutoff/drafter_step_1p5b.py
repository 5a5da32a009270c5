"""One-off timing: the 1.5B coder drafter's step (draft_logits and the layers alone) next to the packed
target. Before pack_drafter (2026-12-06): B=4 21.4 ms (layers 17.5), B=16 23.1 ms (19.3); after: drafter_step_1p5b.txt."""
import time, torch, sys
from dflash_trt.pipeline import load_target, load_drafter
t, _ = load_target("qwen2.5-coder-1.5b-instruct", progress=False)
d = load_drafter(t, "/root/.cache/dflash-trt/runs/q15b/out/drafter")
print("draft vocab", d.draft_vocab is not None, "lm_head", type(t.lm_head).__name__)
tc, dc = t.new_cache(1, 512), d.new_cache(1, 512)
out = t.prefill([list(range(1000, 1300))], tc, list(d.target_layer_ids))
d.inject_context(out.taps, tc.lengths.clone(), dc)
for B in (4, 16):
    block = torch.full((1, B), d.mask_token_id); block[0, 0] = 5
    f = lambda: d.draft_logits(block, dc)
    f(); t0 = time.perf_counter()
    for _ in range(10): f()
    g = lambda: d.draft_block(block, dc)
    ms = (time.perf_counter() - t0) * 100
    g(); t0 = time.perf_counter()
    for _ in range(10): g()
    print(f"B={B}: draft_logits {ms:.1f} ms, layers only {(time.perf_counter() - t0) * 100:.1f} ms", flush=True)
