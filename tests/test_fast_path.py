"""The engine on the Triton kernels (modeling/fast_path.py) == the plain-PyTorch engine.

Runs in Triton's CPU interpreter (TRITON_INTERPRET=1, set before triton is imported, as
tests/test_kernels.py does), on a tiny random Qwen3 target with a drafter of head_dim 32 (the
kernels need a power of two >= 32) and GQA 2. The decode loop with kernels="triton" must emit
exactly the tokens of kernels="torch" (and of plain greedy decoding), and every drafted block's
logits must agree, so the drafter kernels (kv_inject, block_draft_attention) really ran the
same math; the oracle drafter makes every draft accepted, so the accept kernel sees both its
all-accepted and its first-mismatch cases.
"""

import dataclasses
import importlib.util
import os

_PREV_INTERPRET = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed (pip install 'dflash-trt[kernels]')", allow_module_level=True)

from conftest import OracleDrafter, tiny_target  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

import dflash_trt.kernels.accept as accept_mod  # noqa: E402
import dflash_trt.kernels.attention as attention_mod  # noqa: E402
import dflash_trt.kernels.inject as inject_mod  # noqa: E402
from dflash_trt.config import DrafterConfig, SamplingParams  # noqa: E402
from dflash_trt.decoding.engine import SpecEngine  # noqa: E402
from dflash_trt.decoding.loop import generate, generate_baseline  # noqa: E402
from dflash_trt.errors import DFlashError  # noqa: E402
from dflash_trt.modeling import fast_path  # noqa: E402
from dflash_trt.modeling.drafter import DFlashDrafter  # noqa: E402


def _restore_interpret():
    if _PREV_INTERPRET is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _PREV_INTERPRET


_restore_interpret()
if not isinstance(inject_mod.kv_inject_kernel, InterpretedFunction):
    pytest.skip(
        "triton was imported before TRITON_INTERPRET=1 could take effect; run this file on its own",
        allow_module_level=True,
    )


@pytest.fixture(autouse=True, scope="module")
def _triton_interpreter():
    os.environ["TRITON_INTERPRET"] = "1"
    yield
    _restore_interpret()


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3")


def kernel_drafter(target, block_size, head_dim=32, seed=1):
    cfg = DrafterConfig.for_target(target.config, num_layers=2, block_size=block_size)
    cfg = dataclasses.replace(cfg, head_dim=head_dim, rope_theta=10000.0)  # 4 heads, 2 kv heads
    torch.manual_seed(seed)
    d = DFlashDrafter(cfg)
    with torch.no_grad():
        for p in d.parameters():
            if p.dim() == 2:
                p.normal_(0, p.shape[1] ** -0.5)
            else:  # non-trivial norm weights, so k_norm's weight matters
                p.uniform_(0.5, 1.5)
    return d.float().bind(target).eval()


class Spy:
    """Counts calls of a module attribute and records a wrapped method's results."""

    def __init__(self, monkeypatch, module, name):
        self.calls = 0
        fn = getattr(module, name)

        def wrapper(*a, **k):
            self.calls += 1
            return fn(*a, **k)

        monkeypatch.setattr(module, name, wrapper)


def record_draft_logits(monkeypatch, drafter):
    seen = []
    fn = drafter.draft_logits

    def wrapper(block, cache):
        out = fn(block, cache)
        seen.append((block.clone(), out.clone()))
        return out

    monkeypatch.setattr(drafter, "draft_logits", wrapper)
    return seen


PROMPTS = {
    1: [[5, 17, 33, 2, 9, 41, 7]],
    3: [[5, 17, 33, 2, 9, 41, 7], [100], [8, 8, 200, 31, 4, 66, 1, 90, 12, 3, 77]],
}  # ragged


@pytest.mark.parametrize("batch,block_size", [(1, 4), (3, 4), (3, 8)])
def test_decode_loop_on_kernels_equals_torch(target, monkeypatch, batch, block_size):
    prompts = PROMPTS[batch]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    drafter = kernel_drafter(target, block_size)

    seen_torch = record_draft_logits(monkeypatch, drafter)
    ref = generate(target, drafter, prompts, params, kernels="torch")
    assert drafter.kernels == "torch"
    monkeypatch.undo()

    spies = [
        Spy(monkeypatch, inject_mod, "kv_inject"),
        Spy(monkeypatch, attention_mod, "block_draft_attention"),
        Spy(monkeypatch, accept_mod, "greedy_accept"),
    ]
    seen_triton = record_draft_logits(monkeypatch, drafter)
    out = generate(target, drafter, prompts, params, kernels="triton")
    assert drafter.kernels == "triton"

    assert out.tokens == ref.tokens == generate_baseline(target, prompts, params).tokens
    assert out.stats.accept_hist == ref.stats.accept_hist
    assert len(seen_triton) == len(seen_torch) > 1
    for (blk_t, lg_t), (blk_r, lg_r) in zip(seen_triton, seen_torch):
        assert torch.equal(blk_t, blk_r)
        torch.testing.assert_close(lg_t, lg_r, atol=1e-4, rtol=1e-4)
    steps = len(seen_triton)
    # prefill inject + one per step after the first (the first finds its queue empty: the prefill injected
    # every position, and an empty queue is not launched); one attention launch per drafter layer per step;
    # one accept per step
    assert [s.calls for s in spies] == [steps, 2 * steps, steps]


def test_oracle_drafts_all_accepted_by_the_accept_kernel(target, monkeypatch):
    prompts = [[5, 17, 33, 2], [9, 41]]
    params = SamplingParams(max_new_tokens=9, ignore_eos=True)
    ref = generate_baseline(target, prompts, params)
    spy = Spy(monkeypatch, accept_mod, "greedy_accept")
    oracle = OracleDrafter(target, [p + t for p, t in zip(prompts, ref.tokens)], block_size=4)
    out = generate(target, oracle, prompts, params, kernels="triton")
    assert out.tokens == ref.tokens
    assert spy.calls > 0 and out.stats.acceptance_rate == 1.0


def test_sampling_on_kernels_equals_torch(target):
    """Rejection sampling: same seeds -> same tokens on both paths (same uniforms, same verdicts)."""
    drafter = kernel_drafter(target, 4)
    params = SamplingParams(temperature=0.8, top_k=50, max_new_tokens=8, seed=3, ignore_eos=True)
    prompts = PROMPTS[3][:2]
    ref = generate(target, drafter, prompts, params, kernels="torch")
    out = generate(target, drafter, prompts, params, kernels="triton")
    assert out.tokens == ref.tokens


def _scripted_run(target, drafter, params_of, **engine_kw):
    """Requests finish at different steps (max_new_tokens 3, 7, 11) and one joins after step 2,
    so the running batch changes several times. -> ({request: tokens}, engine)."""
    eng = SpecEngine(target, drafter, max_batch=4, max_seq_len=64, **engine_kw)
    eng.add_requests([(str(i), p, params_of(n)) for i, (p, n) in enumerate(zip(PROMPTS[3], (3, 7, 11)))])
    tokens, steps = {}, 0
    while eng.has_unfinished():
        for o in eng.step():
            tokens[o.request_id] = tokens.get(o.request_id, []) + o.new_token_ids
        steps += 1
        if steps == 2:
            eng.add_request("late", [42, 7, 19], params_of(6))
    return tokens, eng


@pytest.mark.parametrize("sampled", [False, True])
def test_graph_replay_equals_eager(target, sampled):
    """The propose step replayed from static buffers (modeling/cuda_graph.py) == the eager loop,
    while rows leave and join. eager_capture stands in for torch.cuda.graph on CPU with a real
    graph's contract: every replay overwrites the same output tensors in place."""
    from dflash_trt.modeling.cuda_graph import eager_capture

    drafter = kernel_drafter(target, 4)

    def params_of(n):
        if sampled:
            return SamplingParams(temperature=0.8, top_k=50, max_new_tokens=n, seed=n, ignore_eos=True)
        return SamplingParams(max_new_tokens=n, ignore_eos=True)

    # the reference is the same kernels run eagerly: the graph adds no arithmetic, so tokens must
    # match bit for bit even when sampling (the PyTorch path rounds differently in the last bits)
    ref, ref_eng = _scripted_run(target, drafter, params_of, kernels="triton", cuda_graph="off")
    out, eng = _scripted_run(target, drafter, params_of, kernels="triton", cuda_graph="on", _capture=eager_capture)
    assert ref_eng.graphs is None and eng.graphs is not None
    assert out == ref and sorted(len(t) for t in out.values()) == [3, 6, 7, 11]
    if not sampled:
        assert out == _scripted_run(target, drafter, params_of, kernels="torch")[0]
    # the batch changes several times; how many of those recapture depends on whether the new cache
    # lands at the old addresses (same rows and storage: the graph stays valid), so no exact count
    assert eng.graphs.captures >= 2
    one = generate(target, drafter, PROMPTS[1], params_of(9), kernels="triton", cuda_graph="on", _capture=eager_capture)
    assert one.tokens == generate(target, drafter, PROMPTS[1], params_of(9), kernels="triton", cuda_graph="off").tokens


def test_graph_recaptured_exactly_when_the_key_changes(target):
    """GraphedPropose recaptures for another cache storage or batch size and replays otherwise."""
    from dflash_trt.modeling.cuda_graph import GraphedPropose, eager_capture

    drafter = kernel_drafter(target, 4)
    drafter.use_kernels("triton")
    gp = GraphedPropose(drafter, eager_capture)
    d = drafter.config.num_taps * drafter.config.hidden_size
    a, b, c = drafter.new_cache(2, 16), drafter.new_cache(2, 16), drafter.new_cache(3, 16)  # alive together

    def call(cache):
        R = cache.batch
        return gp(torch.zeros(R, 4, d), torch.ones(R, dtype=torch.long), torch.zeros(R, dtype=torch.long), cache)

    call(a)
    call(a)
    assert gp.captures == 1
    call(b)  # same shape, other storage
    assert gp.captures == 2
    call(c)  # another batch size
    call(c)
    assert gp.captures == 3
    assert c.lengths.tolist() == [2, 2, 2]  # each replay advanced the rows like inject_context


def test_graph_options_fail_clearly(target):
    drafter = kernel_drafter(target, 4)
    with pytest.raises(DFlashError, match="cuda_graph='on' needs the Triton kernels on a CUDA device"):
        SpecEngine(target, drafter, kernels="torch", cuda_graph="on")
    with pytest.raises(DFlashError, match="cuda_graph='maybe': choose one of auto, on, off"):
        SpecEngine(target, drafter, cuda_graph="maybe")
    assert SpecEngine(target, drafter).graphs is None  # auto on a CPU model: eager
    assert SpecEngine(target, drafter, kernels="triton").graphs is None  # interpreter, no CUDA: eager


def test_stacked_cache_rows_join_and_leave(target):
    drafter = kernel_drafter(target, 4)
    drafter.use_kernels("triton")
    a, b = drafter.new_cache(2, 8), drafter.new_cache(1, 8)
    assert isinstance(a, fast_path.StackedKVCache) and a.k_all.shape == (2, 2, 2, 8 + 8, 32)
    a.k_all.normal_()
    b.k_all.fill_(3.0)
    a.extend(b)
    assert a.k_all.shape[1] == 3 and a.k[1].data_ptr() == a.k_all[1].data_ptr() and a.k_all.is_contiguous()
    a.select_rows(torch.tensor([2]))
    assert bool((a.k[0] == 3.0).all()) and a.lengths.shape == (1,)
    drafter.use_kernels("torch")
    assert type(drafter.new_cache(1, 8)) is fast_path.KVCache


def test_unsupported_combinations_fail_clearly(target, monkeypatch):
    with pytest.raises(DFlashError, match="kernels='fast': expected one of auto, triton, torch"):
        fast_path.resolve("fast", "cpu")
    small = kernel_drafter(target, 4, head_dim=16)
    with pytest.raises(DFlashError, match="head_dim=16: the drafter kernels need a power of two >= 32"):
        small.use_kernels("triton")
    assert small.use_kernels("auto") == "torch"
    # auto on a CPU model stays on the reference, even where the interpreter could run the kernels
    assert fast_path.resolve("auto", "cpu") == "torch" and kernel_drafter(target, 4).use_kernels("auto") == "torch"
    assert SpecEngine(target, small, kernels="auto").accept_ops.name == "torch"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(DFlashError, match="the model is on cpu; the kernels need a CUDA device"):
        generate(target, kernel_drafter(target, 4), [[1, 2]], SamplingParams(max_new_tokens=2), kernels="triton")


def test_block_attention_launcher_accepts_strided_q():
    """q as the drafter makes it (a transposed view) gives the same output as a contiguous q."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 4, 32, generator=g)  # [R, B, H, D]
    kb, vb = torch.randn(2, 2, 4, 32, generator=g), torch.randn(2, 2, 4, 32, generator=g)
    kc, vc = torch.randn(2, 2, 16, 32, generator=g), torch.randn(2, 2, 16, 32, generator=g)
    ctx = torch.tensor([5, 0])
    out = attention_mod.block_draft_attention(q.transpose(1, 2), kb, vb, kc, vc, ctx)
    ref = attention_mod.block_draft_attention(q.transpose(1, 2).contiguous(), kb, vb, kc, vc, ctx)
    assert torch.equal(out, ref)


def test_cli_generate_kernels_option(tmp_path, monkeypatch):
    import json

    from click.testing import CliRunner
    from conftest import tiny_model_dir

    from dflash_trt.cli import main
    from dflash_trt.modeling.target import TargetModel

    target_dir = tiny_model_dir(tmp_path / "target")
    t = TargetModel.from_pretrained(target_dir, dtype=torch.float32)
    kernel_drafter(t, 4).save_pretrained(tmp_path / "drafter")

    def gen(kernels, *extra):
        args = [
            "generate",
            "--target",
            target_dir,
            "--drafter",
            tmp_path / "drafter",
            "--prompt",
            "def add",
            "--max-new-tokens",
            8,
            "--json",
            "--dtype",
            "float32",
            "--kernels",
            kernels,
            *extra,
        ]
        return CliRunner().invoke(main, [str(a) for a in args])

    outs = {}
    for k in ("torch", "triton"):
        r = gen(k)
        assert r.exit_code == 0, r.output
        outs[k] = json.loads(r.stdout)["tokens"]
    assert outs["triton"] == outs["torch"] and len(outs["torch"]) > 1
    r = gen("triton", "--cuda-graph", "on")  # interpreter on a CPU model: no CUDA graph to capture
    assert r.exit_code == 2 and r.output.strip().splitlines()[-1].startswith(
        "error: cuda_graph='on' needs the Triton kernels on a CUDA device"
    )
    monkeypatch.delenv("TRITON_INTERPRET")
    r = gen("triton")
    assert r.exit_code == 2 and r.output.strip().splitlines()[-1].startswith(
        "error: kernels='triton': the model is on cpu; the kernels need a CUDA device"
    )
    r = gen("fast")
    assert r.exit_code == 2 and "'fast' is not one of 'auto', 'triton', 'torch'" in r.output
