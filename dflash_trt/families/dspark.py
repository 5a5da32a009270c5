"""The DSpark drafter family (architecture DSparkDraftModel, SpecForge `projector_type: dspark`):
a DFlash backbone plus
  * a low-rank Markov head that adds to draft position j's logits a bias from the previous token
    (the anchor for the first position, then the previous draft): `vanilla` W2 W1[prev],
    `gated` W2 (sigmoid(gate([h_j, W1[prev]])) * W1[prev]), or `rnn` a gated recurrent state over
    the block's positions whose output tanh(o) goes through W2. Drafting is therefore sequential
    over the B-1 positions (a rank-r matvec each, small next to the LM head);
  * an optional accept-rate predictor (confidence head): sigmoid(w . [h_j (, W1[prev])] + b), the
    chance the target accepts draft j given the drafts before it were accepted. It sets how many
    drafts are verified with draft_length="confidence" (decoding/draft_length.py).

Lossless sampling: draft j is drawn from q_j = warp(corrected logits_j), which depends on the drafts
before j only; the target judges draft j only when those were accepted, so rejection sampling by q_j
is exact. The confidence of position j depends on h_j and draft j-1, never on draft j, so a length
chosen from it is a stopping rule decided before draft j is drawn: lossless as well.

Alignment (sample_from_anchor, default true): the hidden state of block position j (0..B-2, the
anchor's included) drafts the token at block position j+1, with block[j] as its previous token.
That is how SpecForge trains DSpark (OnlineDSparkModel: labels at offsets 1..B) and how vLLM and
SGLang run it by default; dflash-trt drafts B-1 tokens per block from it (the engines draft B, one
more at the block's least likely position). sample_from_anchor false drafts from positions 1..B-1
with the same previous tokens: SpecForge's own spec_generate (DSparkDraftModel._sample_draft_tokens,
specforge 0.2.0) and vLLM's fill-in mode, one position off what training taught.

Boundary: these weights, their config fields and the propose step. The PyTorch drafter only
(CAPS.kernels False); no draft vocabulary, output_multiplier or softcapping (SpecForge has none, so where
the bias goes relative to them is undefined: refused). Tensor names are SpecForge's, vLLM's and
SGLang's (markov_head.*, confidence_head.proj.*); the early `logit_head.` nesting loads too.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_trt.errors import ConfigError
from dflash_trt.families import dflash
from dflash_trt.families.capabilities import ALWAYS_EXCLUDED, LABELS, Capabilities, EngineSupport

NAME, ARCHITECTURE, LABEL = "dspark", "DSparkDraftModel", "DSpark"
PROJECTOR_TYPE = "dspark"
CONFIG_KEYS = (
    "projector_type",
    "markov_rank",
    "markov_head_type",
    "enable_confidence_head",
    "confidence_head_alpha",
    "confidence_head_with_markov",
    "attention_mode",
    "sample_from_anchor",
)
# SpecForge's defaults; enable_confidence_head None = (confidence_head_alpha > 0), as SpecForge derives it
DEFAULTS = {
    "projector_type": PROJECTOR_TYPE,
    "markov_rank": 0,
    "markov_head_type": "vanilla",
    "enable_confidence_head": None,
    "confidence_head_alpha": 0.0,
    "confidence_head_with_markov": False,
    "attention_mode": "gqa",
    "sample_from_anchor": True,
}
TEACHER = "CE + L1 + confidence terms"  # train_terms matches the target's logits at the block positions
# read from dflash_config first, but vLLM and SGLang read these at the top level: written in both places
TOP_LEVEL_TOO = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")
HEAD_TYPES = ("vanilla", "gated", "rnn")
LEGACY_PREFIX = "logit_head."  # early SpecForge checkpoints nest the heads under it


def check_fields(fields: dict, cfg) -> None:
    """Types and ranges of the DSpark fields; derives enable_confidence_head as SpecForge does."""
    if fields["projector_type"] != PROJECTOR_TYPE:
        raise ConfigError(f"dflash_config.projector_type={fields['projector_type']!r}: a DSpark drafter has 'dspark'")
    rank = fields["markov_rank"]
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ConfigError(f"dflash_config.markov_rank={rank!r}: must be an integer >= 0 (0 = no Markov head)")
    kind = fields["markov_head_type"]
    if not isinstance(kind, str) or kind.lower() not in HEAD_TYPES:
        raise ConfigError(f"dflash_config.markov_head_type={kind!r}: choose one of {', '.join(HEAD_TYPES)}")
    fields["markov_head_type"] = kind.lower()
    alpha = fields["confidence_head_alpha"]
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha >= 0:
        raise ConfigError(f"dflash_config.confidence_head_alpha={alpha!r}: must be a number >= 0")
    if fields["enable_confidence_head"] is None:
        fields["enable_confidence_head"] = alpha > 0
    for k in ("enable_confidence_head", "confidence_head_with_markov", "sample_from_anchor"):
        if not isinstance(fields[k], bool):
            raise ConfigError(f"dflash_config.{k}={fields[k]!r}: must be true or false")
    if fields["confidence_head_with_markov"] and rank == 0:
        raise ConfigError("dflash_config.confidence_head_with_markov=true needs markov_rank > 0")
    if fields["attention_mode"] not in ("gqa", "mha"):
        raise ConfigError(f"dflash_config.attention_mode={fields['attention_mode']!r}: choose 'gqa' or 'mha'")
    _refuse_unsupported(cfg, LABEL)


def _refuse_unsupported(cfg, label: str) -> None:
    """Fields of a plain z-lab drafter that SpecForge's DSpark / Domino heads do not define (a draft
    vocabulary is refused by config.py from CAPS.draft_vocab)."""
    for name, plain in (("output_multiplier", 1.0), ("final_logit_softcapping", None)):
        if getattr(cfg, name) != plain:
            raise ConfigError(
                f"dflash_config.{name}={getattr(cfg, name)}: not defined for {label} drafters (SpecForge's heads "
                f"act on the raw LM-head logits); drop the field"
            )


class MarkovHead(nn.Module):
    """bias(prev, h[, state]) over the vocabulary; tensor names as SpecForge's heads."""

    def __init__(self, kind: str, vocab_size: int, rank: int, hidden_size: int):
        super().__init__()
        self.kind, self.rank = kind, rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def step(self, prev: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None):
        """prev [R] token ids, hidden [R, d], state [R, r] (rnn; None before the first position)
        -> (bias [R, V], next state or None)."""
        e = self.markov_w1(prev)  # [R, r]
        if self.kind == "vanilla":
            return self.markov_w2(e), None
        if self.kind == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, e], dim=-1)))
            return self.markov_w2(gate.to(e.dtype) * e), None
        if state is None:
            state = hidden.new_zeros(*hidden.shape[:-1], self.rank)
        g, c, o = self.joint_proj(torch.cat([state, e, hidden], dim=-1)).chunk(3, dim=-1)
        g = torch.sigmoid(g)
        return self.markov_w2(torch.tanh(o)), g * state + (1.0 - g) * torch.tanh(c)

    def block_bias(self, prev: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Teacher-forced biases (training, tests): prev [N, n] the token before each position,
        hidden [N, n, d] -> [N, n, V]."""
        state, out = None, []
        for j in range(prev.shape[1]):
            bias, state = self.step(prev[:, j], hidden[:, j], state)
            out.append(bias)
        return torch.stack(out, dim=1)


class ConfidenceHead(nn.Module):
    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)


def confidence_logits(drafter, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """hidden [..., d], prev [...] -> the confidence head's logit of acceptance [...] (float32)."""
    if drafter.config.family_fields["confidence_head_with_markov"]:
        hidden = torch.cat([hidden, drafter.markov_head.markov_w1(prev).to(hidden.dtype)], dim=-1)
    return drafter.confidence_head.proj(hidden).squeeze(-1).float()


def build(drafter) -> None:
    """markov_head (markov_rank > 0) and confidence_head (enable_confidence_head)."""
    c, f = drafter.config, drafter.config.family_fields
    if f["markov_rank"]:
        drafter.markov_head = MarkovHead(f["markov_head_type"], c.vocab_size, f["markov_rank"], c.hidden_size)
    if f["enable_confidence_head"]:
        width = c.hidden_size + (f["markov_rank"] if f["confidence_head_with_markov"] else 0)
        drafter.confidence_head = ConfidenceHead(width)


def lengths(cfg) -> tuple[str, ...]:
    """ "probability" always; "confidence" when the drafter has the confidence head."""
    return ("probability", "confidence") if cfg.family_fields["enable_confidence_head"] else ("probability",)


def load_keys(state: dict) -> dict:
    """Either layout loads: the heads at top level (SpecForge's current export) or under logit_head."""
    return {k.removeprefix(LEGACY_PREFIX): v for k, v in state.items()}


def save_keys(state: dict) -> dict:
    return state


def proposal_hidden(drafter, hidden: torch.Tensor) -> torch.Tensor:
    """The drafting positions of a block's hidden states [N, B, d] -> [N, B-1, d] (see Alignment)."""
    off = 0 if drafter.config.family_fields["sample_from_anchor"] else 1
    return hidden[:, off : off + hidden.shape[1] - 1]


def corrected_logits(drafter, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """Teacher-forced draft logits: hidden [N, n, d] of the drafting positions (proposal_hidden),
    prev [N, n] the token before each drafted one -> [N, n, V] float32 (base logits plus the bias)."""
    logits = drafter.finish_logits(drafter.head_logits(hidden))
    head = getattr(drafter, "markov_head", None)
    return logits if head is None else logits + head.block_bias(prev, hidden).float()


def propose(drafter, block: torch.Tensor, cache, rows, needs: frozenset, warp, sample):
    """As families/dflash.propose: block [R, B] -> (block with drafts, q [R, B-1, V] or None when
    every row is greedy, {source: [R, B-1]}). Sources: "probability" (greedy rows: the drafted
    token's probability; sampled rows: q's top, never q of the drawn draft) and "confidence" (the
    confidence head's sigmoid)."""
    hidden = proposal_hidden(drafter, drafter.draft_block(block, cache))  # [R, B-1, d]
    base = drafter.finish_logits(drafter.head_logits(hidden))  # [R, B-1, V]
    head = getattr(drafter, "markov_head", None)
    q = None if all(p.greedy for p, _ in rows) else torch.zeros_like(base)
    conf: dict[str, list] = {k: [] for k in needs}
    prev, state = block[:, 0], None
    for j in range(base.shape[1]):
        if "confidence" in needs:
            conf["confidence"].append(torch.sigmoid(confidence_logits(drafter, hidden[:, j], prev)))
        logits = base[:, j]  # [R, V]
        if head is not None:
            bias, state = head.step(prev, hidden[:, j], state)
            logits = logits + bias.float()
        prev = block[:, j + 1] = draw(logits, q, j, rows, conf.get("probability"), warp, sample)
    return block, q, {k: torch.stack(v, dim=1) for k, v in conf.items()}


def draw(logits: torch.Tensor, q, j: int, rows, probability: list | None, warp, sample) -> torch.Tensor:
    """Draft tokens [R] of one position from its corrected logits [R, V]: argmax for greedy rows, a
    draw from q[:, j] = warp(logits) for sampled rows (q is None when every row is greedy). Appends
    the position's "probability" confidence [R] to `probability` when given."""
    tok = logits.argmax(-1)
    sampled = [not p.greedy for p, _ in rows]
    for r, (params, gen) in enumerate(rows):
        if sampled[r]:
            q[r, j] = warp(logits[r], params)
            tok[r] = sample(q[r, j], gen)
    if probability is not None:
        top = dflash.chosen_prob(logits, tok)
        if q is not None:
            top = torch.where(torch.tensor(sampled, device=tok.device), q[:, j].max(-1).values, top)
        probability.append(top)
    return tok


# ---- training (train/objective.family_loss) ------------------------------------------------------
CE_ALPHA, L1_ALPHA, CONF_ALPHA = 0.1, 0.9, 1.0  # SpecForge 0.2.0's OnlineDSparkModel defaults


def init_heads(drafter) -> None:
    """Warm start on a trained backbone: the Markov head's output projection W2 and the confidence
    head start at zero, so the drafter starts with the backbone's logits (W1 and the gates stay random:
    W2's gradient moves first, then theirs)."""
    with torch.no_grad():
        if getattr(drafter, "markov_head", None) is not None:
            drafter.markov_head.markov_w2.weight.zero_()
        if getattr(drafter, "confidence_head", None) is not None:
            drafter.confidence_head.proj.weight.zero_()
            drafter.confidence_head.proj.bias.zero_()


def backbone_mismatch(fields: dict) -> str | None:
    """Why a plain DFlash backbone (init_from: block position k predicts token a+k) cannot start this
    head, or None. With sample_from_anchor the hidden state of position k drafts token a+k+1, so the
    warm-started drafter would begin one token off what its backbone learnt, and a frozen backbone
    never recovers (docs/training.md: the 2026-12-06 DSpark regression)."""
    if fields["sample_from_anchor"]:
        return "family_fields.sample_from_anchor=true drafts token a+k+1 from it: set sample_from_anchor to false"
    return None


def train_logits(drafter, hidden, block_ids, labels) -> torch.Tensor:
    """The draft logits propose computes when its drafts are the labels: hidden [N, J, B, d] of the
    training forward, block_ids [N, J, B], labels [N, J, B-1] -> [N, J, B-1, V] float32."""
    return _teacher_forced(drafter, hidden, block_ids, labels)[2].view(*labels.shape, -1)


def _teacher_forced(drafter, hidden, block_ids, labels):
    """-> (drafting hidden [NJ, B-1, d], true previous tokens [NJ, B-1], corrected logits [NJ, B-1, V])."""
    prev = dflash.previous_tokens(block_ids, labels)
    h = proposal_hidden(drafter, hidden.flatten(0, 1))
    return h, prev, corrected_logits(drafter, h, prev)


def train_terms(drafter, hidden, block_ids, labels, teacher=None, ce_alpha=None, l1_alpha=None, conf_alpha=None):
    """The DSpark objective of SpecForge 0.2.0 (OnlineDSparkModel._dspark_objective_chunk_terms),
    teacher-forced as propose drafts: hidden [N, J, B, d] of the training forward, block_ids [N, J, B],
    labels [N, J, B-1] (the token of block positions 1..B-1), teacher [N, J, B-1, V] the target's
    logits for those tokens (None: CE alone) -> ([(alpha, per-position loss [N, J, B-1])], greedy
    drafts [N, J, B-1]). With z = corrected_logits (the drafting position's logits plus the Markov
    bias of the true previous token), q = softmax(z), p = softmax(teacher):
      CE = -log q[label];  L1 = sum_v |q_v - p_v|;  accept = clamp(1 - L1 / 2, 0, 1);
      conf = BCE(confidence logit, accept.detach())
    and the loss is ce_alpha*CE + l1_alpha*L1 + conf_alpha*conf (defaults 0.1, 0.9, 1.0). Without a
    teacher the loss is CE alone (ce_alpha defaults to 1) and the confidence head is not trained."""
    h, prev, logits = _teacher_forced(drafter, hidden, block_ids, labels)
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    shape = labels.shape
    predicted = logits.argmax(-1).view(shape)
    if teacher is None:
        return [(1.0 if ce_alpha is None else ce_alpha, ce.view(shape))], predicted
    q = logits.softmax(-1)
    p = teacher.detach().float().flatten(0, 1).softmax(-1)
    l1 = (q - p).abs().sum(-1)  # [NJ, B-1]
    terms = [(CE_ALPHA if ce_alpha is None else ce_alpha, ce.view(shape))]
    terms.append((L1_ALPHA if l1_alpha is None else l1_alpha, l1.view(shape)))
    if getattr(drafter, "confidence_head", None) is not None:
        accept = (1.0 - 0.5 * l1).clamp(0.0, 1.0).detach()
        conf = torch.nn.functional.binary_cross_entropy_with_logits(
            confidence_logits(drafter, h, prev), accept, reduction="none"
        )
        terms.append((CONF_ALPHA if conf_alpha is None else conf_alpha, conf.view(shape)))
    return terms, predicted


# ---- deploy capabilities (families/capabilities.py; read by deploy/ and the engine switches) ----------------
# vLLM 0.33 (model_executor/models/qwen3_dspark.py): markov_w2 is a ParallelLMHead that takes the draft's
# quant_config (:72-78), so an unquantized head must be in exclude_modules or vLLM treats it as FP8 and its
# scales stay uninitialised; the confidence head is an fp32 ReplicatedLinear without quant_config (:176-182);
# DSparkMarkovHead is vanilla W2 W1[prev] only (:61-80); markov_rank is read with no default (:209-212).
# SGLang 0.5.23: DSparkDraftModel subclasses DFlashDraftModel (srt/models/dspark.py:967), whose
# supports_quantization is False (models/dflash.py:685); DSpark without a Markov head raises (dspark.py:385-391).
# TensorRT-LLM: GQADSparkForCausalLM raises for gated / rnn heads and drafts from the anchor slot.
def _engine_refusal(engine: str, fields: dict, drafter_quant: str) -> str | None:
    if engine == "torch":
        return None
    if not fields["markov_rank"]:
        return (
            f"a DSpark drafter with markov_rank=0 has no Markov head, which {LABELS[engine]} needs; use backend: torch"
        )
    if engine != "sglang" and fields["markov_head_type"] != "vanilla":
        return (
            f"{LABELS[engine]} implements only the vanilla DSpark Markov head (this drafter's markov_head_type="
            f"{fields['markov_head_type']}); serve it with sglang or backend: torch"
        )
    if engine == "trtllm-pytorch" and not fields["sample_from_anchor"]:
        return (
            "TensorRT-LLM's DSpark drafts from the anchor slot (shift_label), this drafter has "
            "sample_from_anchor: false; use backend: torch"
        )
    return None


def _serving_drafts(dc) -> int:
    """vLLM, SGLang and TensorRT-LLM draft from all B positions with sample_from_anchor (vLLM
    dspark/speculator.py:46-55, SGLang dspark_config.py:295-297), B-1 in fill-in mode."""
    return dc.block_size if dc.family_fields["sample_from_anchor"] else dc.block_size - 1


CAPS = Capabilities(
    engines={
        # vLLM's DSparkSpeculator reads sample_from_anchor at the top level (dspark/speculator.py:49-51), but
        # its parent DFlashSpeculator refuses dflash_config.sample_from_anchor=true (dflash/speculator.py:80-88)
        "vllm": EngineSupport(
            "dspark",
            quantized_drafter=True,
            top_level_only=("sample_from_anchor",),
            source="qwen3_dspark.py:72-78,176-182; v1/worker/gpu/spec_decode/dflash/speculator.py:80-88",
        ),
        "sglang": EngineSupport("DSPARK", source="srt/models/dspark.py:967, models/dflash.py:685"),
        "trtllm-pytorch": EngineSupport("DSpark", source="tensorrt_llm GQADSparkForCausalLM"),
        "torch": EngineSupport("dspark", quantized_drafter=True),
    },
    quant_exclude=(*ALWAYS_EXCLUDED, "markov_head*", "confidence_head*"),
    top_level=(*TOP_LEVEL_TOO, "sample_from_anchor"),
    field_refusal=_engine_refusal,
    drafts=_serving_drafts,
)
