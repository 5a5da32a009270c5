"""The plain DFlash drafter family (architecture DFlashDraftModel): draft tokens come straight from
the draft logits, argmax (greedy) or a sample from q = warp(draft logits) (temperature, top-k, top-p,
the same warp as the target's p).

Boundary: the propose step of this family (choose); no weights or config fields of its own.
The sampling functions are passed in (decoding/verify.py) so this package stays below config.
"""

from __future__ import annotations

import torch

from dflash_trt.families.capabilities import ALWAYS_EXCLUDED, Capabilities, EngineSupport

NAME, ARCHITECTURE, LABEL = "dflash", "DFlashDraftModel", "DFlash"
CONFIG_KEYS: tuple[str, ...] = ()
TOP_LEVEL_TOO: tuple[str, ...] = ()
TEACHER: str | None = None  # train_terms does not read the target's logits
DEFAULTS: dict = {}
PROJECTOR_TYPE = None


def check_fields(fields: dict, cfg) -> None:
    return None


def build(drafter) -> None:
    return None


def load_keys(state: dict) -> dict:
    return state


def save_keys(state: dict) -> dict:
    return state


def lengths(cfg) -> tuple[str, ...]:
    """The draft-length sources propose can serve (decoding/draft_length.py): "probability" = the
    drafter's probability of each draft (draft_cutoff), "confidence" = a learned acceptance head."""
    return ("probability",)


def propose(drafter, block: torch.Tensor, cache, rows, needs: frozenset, warp, sample):
    """block [R, B] (column 0 = last verified token, rest mask) -> (block with drafts, q [R, B-1, V] or
    None when every row is greedy, {source: confidence [R, B-1]} for each source in `needs`, a subset
    of lengths(cfg)). rows: (params, generator) per row; warp(logits, params) -> probs and
    sample(probs, generator) -> ids."""
    greedy = all(p.greedy for p, _ in rows)
    vocab = getattr(drafter, "draft_vocab", None)  # ids of the drafter's logit columns (None: all)
    if greedy and vocab is not None:  # greedy drafts need only the draft vocabulary's columns
        logits = drafter.draft_logits(block, cache, full_vocab=False)  # [R, B-1, Vd]
    else:
        logits, vocab = drafter.draft_logits(block, cache), None  # [R, B-1, V]
    block, q, conf = choose(block, logits, vocab, rows, "probability" in needs, warp, sample)
    return block, q, ({} if conf is None else {"probability": conf})


def choose(block: torch.Tensor, logits: torch.Tensor, vocab, rows, gated: bool, warp, sample):
    """Drafts from draft logits [R, B-1, Vd] (vocab: ids of the columns, None for the full vocabulary);
    returns as propose. Also the CUDA graph's second half (modeling/cuda_graph.py replays the logits)."""
    if all(p.greedy for p, _ in rows):
        col = logits.argmax(-1)  # draft vocabularies are sorted ids: ties resolve as over V
        block[:, 1:] = col if vocab is None else vocab[col]
        return block, None, (chosen_prob(logits, col) if gated else None)
    q = torch.zeros_like(logits)
    for r, (params, gen) in enumerate(rows):
        if params.greedy:  # a one-hot q makes rejection sampling exactly greedy acceptance
            block[r, 1:] = logits[r].argmax(-1)
        else:
            q[r] = warp(logits[r], params)
            block[r, 1:] = sample(q[r], gen)
    conf = None
    if gated:  # a sampled row's confidence is q's top probability, never q of the sampled draft (lossless)
        conf = torch.stack(
            [
                chosen_prob(logits[r], block[r, 1:]) if params.greedy else q[r].max(-1).values
                for r, (params, _) in enumerate(rows)
            ]
        )
    return block, q, conf


def previous_tokens(block_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Teacher forcing (training): the token before each drafted one when every draft is right.
    block_ids [N, J, B] (anchor first), labels [N, J, B-1] -> [N*J, B-1]: the anchor, then the labels."""
    return torch.cat([block_ids[..., :1], labels[..., :-1]], dim=-1).flatten(0, 1)


def chosen_prob(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """softmax(logits)[..., ids] without materialising the softmax: logits [..., V], ids [...]."""
    logits = logits.float()
    return (logits.gather(-1, ids[..., None]).squeeze(-1) - logits.logsumexp(-1)).exp()


# ---- deploy capabilities (families/capabilities.py; read by deploy/ and the engine switches) ----------------
# vLLM 0.33: every linear of DFlashQwen3Model takes the draft's quant_config (model_executor/models/
# qwen3_dflash.py:466-486, fc :477) and its draft vocabulary is lm_head rows + d2t (:745-775, :851-884).
# SGLang 0.5.23: DFlashDraftModel.supports_quantization = False (srt/models/dflash.py:685), so fc is a plain
# nn.Linear (:772) that would read fp8 codes as values; SGLang has no draft vocabulary.
# TensorRT-LLM: its DFlash drafter projects context K/V with the raw qkv_proj weights and a plain nn.Linear fc
# (bf16 drafter only), and loads with allow_partial_loading over the target's full LM head (no draft vocabulary).
CAPS = Capabilities(
    engines={
        "vllm": EngineSupport("dflash", quantized_drafter=True, draft_vocab=True, source="qwen3_dflash.py:466-486"),
        "sglang": EngineSupport("DFLASH", source="srt/models/dflash.py:685,772"),
        "trtllm-pytorch": EngineSupport("DFlash", source="tensorrt_llm DFlashForCausalLM.load_weights"),
        "torch": EngineSupport("dflash", quantized_drafter=True, draft_vocab=True),
    },
    quant_exclude=ALWAYS_EXCLUDED,
    kernels=True,
    cuda_graph=True,
    draft_vocab=True,
)
