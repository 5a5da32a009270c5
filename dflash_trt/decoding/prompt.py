"""check_prompt: the one validation of a prompt's token ids before it reaches a model.

Boundary: refuses what no engine can run (an empty prompt, ids outside the target's vocabulary,
a prompt that leaves no room in the context) with one line naming the field and the fix. Used by
SpecEngine.add_requests (decoding/engine.py) and the serving orchestrator's submit
(serving/orchestrator.py), which only differ in the field name their callers know. Request-level
checks (duplicate ids, batch capacity) stay with the engine.
"""

from __future__ import annotations

from dflash_trt.errors import DFlashError


def check_prompt(
    ids: list[int], vocab_size: int, max_seq_len: int, field: str = "prompt_ids", length_field: str | None = None
) -> None:
    """ids: the prompt's token ids. Raises DFlashError("<field>: ...") on the first problem.
    length_field names the field a too-long prompt is blamed on when that differs (the text front
    door's clients send text_input, which the preprocessing model turns into input_ids)."""
    if not ids:
        raise DFlashError(f"{field}: prompt is empty; give at least one token")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise DFlashError(f"{field}: token ids {bad[:4]} outside the vocabulary 0..{vocab_size - 1}")
    if len(ids) >= max_seq_len:  # the context must keep room for at least one generated token
        raise DFlashError(
            f"{length_field or field}: prompt has {len(ids)} tokens but the context is max_seq_len={max_seq_len}; "
            f"shorten the prompt or raise max_seq_len"
        )
