"""One-off timing behind README "Verifying only the drafts the drafter is sure of": the drafter's
step and the target's verify pass by width, Qwen2.5-Coder-0.5B (packed fp32) with the 512-answer
hard-label drafter, 300-token context, 2 threads. Run: python step_costs.py > step_costs.txt"""
import sys, time, torch
from dflash_trt.pipeline import load_target, load_drafter
from dflash_trt.spec.engine import _chosen_prob
t, _ = load_target("qwen2.5-coder-0.5b-instruct", progress=False)
d = load_drafter(t, sys.argv[1] if len(sys.argv) > 1 else "/root/.cache/dflash-trt/runs/kd/out_hard/drafter")
print("packed", t.packed, "draft vocab", getattr(d.config, "draft_vocab_size", None))
ids = list(range(1000, 1300))
tc, dc = t.new_cache(1, 512), d.new_cache(1, 512)
out = t.prefill([ids], tc, list(d.target_layer_ids))
d.inject_context(out.taps, tc.lengths.clone(), dc)
B = 16
block = torch.full((1, B), d.mask_token_id); block[0, 0] = 5
def tm(f, n=10):
    f(); t0 = time.perf_counter()
    for _ in range(n): r = f()
    return (time.perf_counter() - t0) / n * 1e3, r
ms, logits = tm(lambda: d.draft_logits(block, dc))
print(f"draft_logits B=16: {ms:.1f} ms, logits {tuple(logits.shape)}")
ms_c, _ = tm(lambda: d.draft_logits(block, dc, full_vocab=False))
print(f"draft_logits B=16 over the draft vocabulary only: {ms_c:.1f} ms")
print(f"argmax: {tm(lambda: logits.argmax(-1))[0]:.1f} ms; conf: {tm(lambda: _chosen_prob(logits, logits.argmax(-1)))[0]:.1f} ms")
hid = torch.randn(1, B, d.config.hidden_size)
ms_blk, _ = tm(lambda: d.draft_block(block, dc))
print(f"draft_block (layers only): {ms_blk:.1f} ms")
taps = torch.randn(1, B, out.taps.shape[-1])
def inj():
    dc.lengths = dc.lengths.clone(); n0 = dc.lengths.clone(); d.inject_context(taps, torch.tensor([2]), dc); dc.lengths = n0
print(f"inject: {tm(inj)[0]:.1f} ms")
for W in (1, 2, 4, 16):
    blk = block[:, :W]
    def ver():
        o = t.forward(blk, tc, list(d.target_layer_ids)); tc.crop(tc.lengths - W); return o
    print(f"verify W={W}: {tm(ver)[0]:.1f} ms")
