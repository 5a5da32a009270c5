"""The Domino drafter family (architecture DominoDraftModel, SpecForge `projector_type: domino`):
a DFlash backbone plus a GRU over the block's token embeddings whose state corrects the logits.

With P = pure_draft_prefix_len, block position t's logits are the LM head's, plus (from a start
position on) embed_proj([h_t, g]) where embed_proj = Linear(d + H, emb_dim) -> SiLU ->
Linear(emb_dim, V) and g is the GRU state after reading the embeddings of the tokens before the
drafted one:
  * shift_label false: token t (1..B-1) is drafted from position t's logits; corrected for
    t >= 1 + P with g = GRU(emb(block[0..t-1]));
  * shift_label true: token t is drafted from position t-1's logits (the backbone was trained to
    predict the next token); corrected for t-1 >= P with g = GRU(emb(block[0..t-1])).
Either way the correction of draft t reads only the tokens before it, so drafting is sequential
(one GRU step per position) and causal: q_t = warp(corrected logits) depends on drafts < t only,
which keeps rejection sampling exact. The embeddings are the target's raw embedding rows, as
SpecForge's DominoDraftModel reads `embed_tokens` (specforge 0.2.0, modeling/draft/domino.py).

Boundary: these weights (prefix_gru, embed_proj), their config fields and the propose step.
The PyTorch drafter only (CAPS.kernels False); no draft vocabulary, output_multiplier or softcapping.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_trt.errors import ConfigError
from dflash_trt.families import dspark
from dflash_trt.families.capabilities import ALWAYS_EXCLUDED, Capabilities, EngineSupport

NAME, ARCHITECTURE, LABEL = "domino", "DominoDraftModel", "Domino"
PROJECTOR_TYPE = "domino"
CONFIG_KEYS = ("projector_type", "emb_dim", "gru_hidden_dim", "pure_draft_prefix_len", "shift_label")
DEFAULTS = {"projector_type": PROJECTOR_TYPE, "pure_draft_prefix_len": 0, "shift_label": False}
TOP_LEVEL_TOO: tuple[str, ...] = ()
TEACHER: str | None = None  # train_terms does not read the target's logits


def check_fields(fields: dict, cfg) -> None:
    if fields["projector_type"] != PROJECTOR_TYPE:
        raise ConfigError(f"dflash_config.projector_type={fields['projector_type']!r}: a Domino drafter has 'domino'")
    for k in ("emb_dim", "gru_hidden_dim"):
        v = fields[k]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"dflash_config.{k}={v!r}: a Domino drafter needs a positive integer")
    p = fields["pure_draft_prefix_len"]
    if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p <= cfg.block_size - 2:
        raise ConfigError(
            f"dflash_config.pure_draft_prefix_len={p!r}: must be an integer in 0..{cfg.block_size - 2} "
            f"(block_size={cfg.block_size}: at least one corrected draft)"
        )
    if not isinstance(fields["shift_label"], bool):
        raise ConfigError(f"dflash_config.shift_label={fields['shift_label']!r}: must be true or false")
    dspark._refuse_unsupported(cfg, LABEL)


def build(drafter) -> None:
    """prefix_gru (one layer, no bias) and embed_proj (Linear, SiLU, Linear), SpecForge's names."""
    c, f = drafter.config, drafter.config.family_fields
    drafter.prefix_gru = nn.GRU(c.hidden_size, f["gru_hidden_dim"], num_layers=1, batch_first=True, bias=False)
    drafter.embed_proj = nn.Sequential(
        nn.Linear(c.hidden_size + f["gru_hidden_dim"], f["emb_dim"], bias=False),
        nn.SiLU(),
        nn.Linear(f["emb_dim"], c.vocab_size, bias=False),
    )


def lengths(cfg) -> tuple[str, ...]:
    return ("probability",)


def load_keys(state: dict) -> dict:
    return dspark.load_keys(state)  # the same legacy logit_head. nesting


def save_keys(state: dict) -> dict:
    return state


def _first_corrected(fields: dict) -> int:
    """The first drafted token (1..B-1) whose logits are corrected."""
    return 1 + fields["pure_draft_prefix_len"]


def proposal_hidden(drafter, hidden: torch.Tensor) -> torch.Tensor:
    """A block's hidden states [N, B, d] -> those whose logits draft tokens 1..B-1 [N, B-1, d]: positions
    0..B-2 with shift_label (the backbone predicts the next token), else 1..B-1."""
    off = 0 if drafter.config.family_fields["shift_label"] else 1
    return hidden[:, off : off + hidden.shape[1] - 1]


def corrected_logits(drafter, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Teacher-forced draft logits: hidden [N, B, d] of the whole block, tokens [N, B] (anchor, then
    the tokens each position drafts) -> [N, B-1, V] float32, row t-1 drafting token t."""
    f = drafter.config.family_fields
    h = proposal_hidden(drafter, hidden)  # [N, B-1, d]
    logits = drafter.finish_logits(drafter.head_logits(h))
    g = drafter.prefix_gru(drafter.target.embed(tokens[:, :-1]).to(h.dtype))[0]  # [N, B-1, H], row t-1 read 0..t-1
    start = _first_corrected(f) - 1
    fix = drafter.embed_proj(torch.cat([h[:, start:], g[:, start:]], dim=-1)).float()
    return torch.cat([logits[:, :start], logits[:, start:] + fix], dim=1)


def propose(drafter, block: torch.Tensor, cache, rows, needs: frozenset, warp, sample):
    """As families/dspark.propose (source "probability" only: Domino has no confidence head)."""
    f = drafter.config.family_fields
    B = block.shape[1]
    h = proposal_hidden(drafter, drafter.draft_block(block, cache))  # [R, B-1, d]
    base = drafter.finish_logits(drafter.head_logits(h))  # [R, B-1, V]
    q = None if all(p.greedy for p, _ in rows) else torch.zeros_like(base)
    conf: dict[str, list] = {k: [] for k in needs}
    state = None
    for t in range(1, B):
        # the GRU state after tokens 0..t-1: one step on token t-1
        out, state = drafter.prefix_gru(drafter.target.embed(block[:, t - 1 : t]).to(h.dtype), state)
        logits = base[:, t - 1]
        if t >= _first_corrected(f):
            logits = logits + drafter.embed_proj(torch.cat([h[:, t - 1], out[:, 0]], dim=-1)).float()
        block[:, t] = dspark.draw(logits, q, t - 1, rows, conf.get("probability"), warp, sample)
    return block, q, {k: torch.stack(v, dim=1) for k, v in conf.items()}


# ---- training (train/objective.family_loss) ------------------------------------------------------
def init_heads(drafter) -> None:
    """Warm start on a trained backbone (bound to its target): embed_proj's output layer starts at
    zero, so the corrected logits start as the backbone's. The GRU reads the target's raw embedding
    rows, often far smaller than unit scale (0.02 in an HF init): its input weights are scaled so that
    each input gate sees unit variance, else the state hardly depends on the tokens until those
    weights have grown."""
    with torch.no_grad():
        drafter.embed_proj[2].weight.zero_()
        rows = torch.arange(min(drafter.config.vocab_size, 4096), device=drafter.target.device)
        scale = float(drafter.target.embed(rows).float().std().clamp_min(1e-6))  # a sample of the rows
        w = drafter.prefix_gru.weight_ih_l0  # [3H, d]
        w.normal_(0.0, 1.0 / (w.shape[1] ** 0.5 * scale))


def backbone_mismatch(fields: dict) -> str | None:
    """As dspark.backbone_mismatch: with shift_label, position k drafts token a+k+1."""
    if fields["shift_label"]:
        return "family_fields.shift_label=true drafts token a+k+1 from it: set shift_label to false"
    return None


def train_logits(drafter, hidden, block_ids, labels) -> torch.Tensor:
    """The draft logits propose computes when its drafts are the labels: hidden [N, J, B, d] of the
    training forward, block_ids [N, J, B], labels [N, J, B-1] -> [N, J, B-1, V] float32."""
    tokens = torch.cat([block_ids[..., :1], labels], dim=-1).flatten(0, 1)  # [NJ, B]: anchor, then the labels
    return corrected_logits(drafter, hidden.flatten(0, 1), tokens).view(*labels.shape, -1)


def train_terms(drafter, hidden, block_ids, labels, teacher=None, lambda_base: float = 0.0):
    """SpecForge 0.2.0's OnlineDominoModel objective, teacher-forced as propose drafts: hidden
    [N, J, B, d], block_ids [N, J, B], labels [N, J, B-1] (tokens of block positions 1..B-1; with
    shift_label, drafted from positions 0..B-2, otherwise from 1..B-1: corrected_logits aligns them)
    -> ([(alpha, per-position loss [N, J, B-1])], greedy drafts [N, J, B-1]). Loss per position:
    (1 - lambda_base) * CE(corrected logits, label) + lambda_base * CE(backbone logits, label), the
    GRU reading the true tokens before each label. teacher is unused (Domino trains on labels only)."""
    logits = train_logits(drafter, hidden, block_ids, labels).flatten(0, 1)  # [NJ, B-1, V]
    shape = labels.shape
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(shape)
    terms = [(1.0 - lambda_base, ce)]
    if lambda_base:
        base = drafter.finish_logits(drafter.head_logits(proposal_hidden(drafter, hidden.flatten(0, 1))))
        base_ce = torch.nn.functional.cross_entropy(base.flatten(0, 1), labels.flatten(), reduction="none")
        terms.append((lambda_base, base_ce.view(shape)))
    return terms, logits.argmax(-1).view(shape)


# ---- deploy capabilities (families/capabilities.py; read by deploy/ and the engine switches) ----------------
# vLLM 0.33 has no Domino model or speculator (model_executor/models/registry.py:654-680). SGLang 0.5.23 runs
# it as DFlashDraftModel with dflash_config.projector_type domino (speculative/dflash_utils.py:727-790),
# pure_draft_prefix_len 1 only (:779-783), bf16 projector weights (speculative/domino_utils.py:293-307) and
# supports_quantization False (models/dflash.py:685). TensorRT-LLM's speculative_config has no Domino.
def _engine_refusal(engine: str, fields: dict, drafter_quant: str) -> str | None:
    if engine == "sglang" and fields["pure_draft_prefix_len"] != 1:
        return (
            f"SGLang 0.5.23 runs Domino drafters with pure_draft_prefix_len=1 only (this one has "
            f"{fields['pure_draft_prefix_len']}); train with pure_draft_prefix_len: 1, or serve it with backend: torch"
        )
    return None


CAPS = Capabilities(
    engines={
        "sglang": EngineSupport("DFLASH", architecture="DFlashDraftModel", source="dflash_utils.py:727-790"),
        "torch": EngineSupport("domino", quantized_drafter=True),
    },
    refused={
        "vllm": "vLLM 0.33 has no Domino drafter; emit sglang instead, or serve it with backend: torch",
        "trtllm-pytorch": (
            "TensorRT-LLM has no Domino drafter (its speculative_config takes DFlash or DSpark); SGLang runs it "
            "(backend: torch with emit: [sglang] writes its command), and dflash-trt's torch backend runs every family"
        ),
    },
    quant_exclude=(*ALWAYS_EXCLUDED, "prefix_gru*", "embed_proj*"),
    field_refusal=_engine_refusal,
)
