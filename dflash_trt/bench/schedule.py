"""The interleaved schedule shared by the bench and its sweeps: every prompt, every method in
turn (A B A B ...), with the greedy exactness check against the reference; and `fit_prompt`, which
cuts or pads a prompt to a token length.

Boundary: runs methods that are already prepared on items that are already encoded; loading and
reporting live in runner.py / report.py. runner.py (the bench) and scaling.py (the sweeps) both
run their schedules through here, so neither imports the other's module for it.
"""

from __future__ import annotations

from dflash_trt.api import encode
from dflash_trt.bench.methods import Item, Run
from dflash_trt.config import SamplingParams


# ---- prompts -------------------------------------------------------------------------------
def fit_prompt(tokenizer, text: str, chat: bool, length: int | None, filler: str = "") -> tuple[str, list[int]]:
    """(text, ids) with the prompt cut (or, with `filler`, padded in front) so that the encoded
    prompt has about `length` tokens; None keeps it. Cuts are made on the content tokens, so the
    chat template stays intact; the re-encoded length can differ from `length` by a token or two."""
    ids = encode(tokenizer, text, chat)
    if length is None or len(ids) == length or (len(ids) < length and not filler):
        return text, ids
    overhead = len(ids) - len(tokenizer(text, add_special_tokens=False)["input_ids"])
    need = max(1, length - overhead)
    content = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(content) > need:
        content = content[:need]
    else:
        pad = tokenizer(filler, add_special_tokens=False)["input_ids"] or content
        pad = (pad * (need // max(1, len(pad)) + 1))[: need - len(content)]
        content = pad + content
    text = tokenizer.decode(content, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return text, encode(tokenizer, text, chat)


# ---- running -------------------------------------------------------------------------------
def first_difference(a, b) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check_exact(ctx, method, run: Run, ref: Run, item: Item) -> str | None:
    """None if `run` equals the reference, else a message naming method, prompt and position."""
    if run.tokens is None:  # text-only method: compare with the reference's decoded text
        want = ctx.tokenizer.decode(ref.tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        i = first_difference(run.text or "", want)
        if i is None:
            return None
        return (
            f"{method} differs from the reference on {item.key} at character {i}: "
            f"{(run.text or '')[i:i + 20]!r} vs {want[i:i + 20]!r}"
        )
    i = first_difference(run.tokens, ref.tokens)
    if i is None:
        return None
    got = run.tokens[i] if i < len(run.tokens) else "end"
    exp = ref.tokens[i] if i < len(ref.tokens) else "end"
    return (
        f"{method} differs from the reference on {item.key} at output token {i} "
        f"(got {got}, expected {exp}; {len(run.tokens)} vs {len(ref.tokens)} tokens)"
    )


def run_schedule(
    methods: dict,
    items: list[Item],
    params: SamplingParams,
    reference: str | None,
    ctx,
    mismatches: list[str],
    on_run=None,
    say=print,
) -> list[dict]:
    """Every prompt, every method in turn; one record per (prompt, method)."""
    records = []
    for item in items:
        by_method = {}
        for name, m in methods.items():
            rec = {
                "dataset": item.dataset,
                "prompt": item.id,
                "method": name,
                "prompt_tokens": len(item.ids),
                "run": m.run(item, params),
                "item": item,
            }
            records.append(rec)
            by_method[name] = rec
            if on_run:
                on_run(rec)
        if params.greedy and reference in by_method:
            mark_mismatches(methods, by_method, reference, ctx, item, mismatches, say)
    return records


def mark_mismatches(
    methods: dict, by_method: dict[str, dict], reference: str, ctx, item: Item, mismatches: list[str], say=print
) -> None:
    """Greedy output of a lossless method must equal the reference's on this prompt: each method's
    record that differs is marked, said and listed in `mismatches`."""
    ref = by_method[reference]["run"]
    for name, rec in by_method.items():
        if name == reference or not methods[name].lossless:
            continue
        msg = check_exact(ctx, name, rec["run"], ref, item)
        if msg:
            say(f"MISMATCH: {msg}")
            mismatches.append(msg)
            rec["mismatch"] = msg
