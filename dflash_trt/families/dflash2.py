"""The DFlash 2 drafter family (architecture DFlash2DraftModel): plain DFlash plus
  * a grouped dynamic causal convolution around each layer's attention and MLP, over the block
    positions: `prepare` before (base kernel 0 + a per-position kernel projected from the input),
    `finish` after (base kernel 1 + the second half of that projection);
  * a candidate selector: the top-k of the draft logits at every block position, walked left to
    right from the anchor (last verified) token; candidate c after token prev scores
    logit(c) + <pred_codebook(prev) * proj(hidden), succ_codebook(c)>. Greedy takes the argmax
    path; sampling draws from q = softmax(scores / T) over the k candidates, and acceptance uses
    that q scattered onto the vocabulary (zero off the candidates), so rejection sampling stays
    exact. As in the reference, q has no top-k / top-p (the target's p has them).

Boundary: these weights, their config fields (conv_kernel_size, conv_group_size, selector_rank,
selector_top_k) and the propose step. The PyTorch drafter only: the Triton kernels, CUDA graph,
TensorRT and draft vocabularies do not implement it (refused or routed to PyTorch by their owners).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trt.errors import ConfigError
from dflash_trt.families import dflash
from dflash_trt.families.capabilities import ALWAYS_EXCLUDED, Capabilities, EngineSupport

NAME, ARCHITECTURE, LABEL = "dflash2", "DFlash2DraftModel", "DFlash 2"
CONFIG_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
TOP_LEVEL_TOO: tuple[str, ...] = ()
TEACHER: str | None = None  # train_terms does not read the target's logits
DEFAULTS: dict = {}
PROJECTOR_TYPE = None
SELECTOR = "candidate_selector"
CODEBOOKS = ("predecessor_codebook", "successor_codebook")  # published without the `.weight` suffix


def check_fields(fields: dict, cfg) -> None:
    """The four fields are required positive integers; groups tile hidden_size, top-k fits the vocabulary."""
    for k in CONFIG_KEYS:
        v = fields.get(k)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"dflash_config.{k}={v!r}: a DFlash 2 drafter needs a positive integer")
    if cfg.hidden_size % fields["conv_group_size"]:
        raise ConfigError(
            f"dflash_config.conv_group_size={fields['conv_group_size']} does not divide hidden_size={cfg.hidden_size}"
        )
    if fields["selector_top_k"] > cfg.vocab_size:
        raise ConfigError(
            f"dflash_config.selector_top_k={fields['selector_top_k']} exceeds vocab_size={cfg.vocab_size}"
        )


class GroupedCausalConv(nn.Module):
    """Per-group dynamic causal convolution over the positions of x [R, n, d]."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * (hidden_size // group_size), bias=False)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [R, n, d] -> (convolved x [R, n, d], the dynamic kernel for finish [R, n, K, G])."""
        dyn = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, x.shape[-1] // self.group_size)
        return _convolve(x, dyn[..., 0, :, :], self.base_kernel[0], self.group_size), dyn[..., 1, :, :]

    def finish(self, x: torch.Tensor, dyn: torch.Tensor) -> torch.Tensor:
        return _convolve(x, dyn, self.base_kernel[1], self.group_size)


def _convolve(x: torch.Tensor, dyn: torch.Tensor, base: torch.Tensor, group: int) -> torch.Tensor:
    """x [R, n, d], dyn [R, n, K, G], base [K, d] -> y [R, n, d]:
    y[t, g] = sum_o (base[o, g] + dyn[t, o, g]) * x[t - o, g]  (x before position 0 is zero)."""
    R, n, d = x.shape
    xg = x.view(R, n, d // group, group)
    y = torch.zeros_like(xg)
    for o in range(base.shape[0]):
        if o >= n:
            break
        shifted = xg if o == 0 else F.pad(xg[:, : n - o], (0, 0, 0, 0, o, 0))
        y = y + base[o].view(1, 1, d // group, group).to(x.dtype) * shifted
        y = y + dyn[:, :, o, :, None] * shifted
    return y.view(R, n, d)


class CandidateSelector(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Embedding(vocab_size, rank)
        self.successor_codebook = nn.Embedding(vocab_size, rank)
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def walk(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor, rows):
        """hidden [R, n, d], draft logits [R, n, V], anchor [R] -> (path [R, n], candidates [R, n, k],
        q [R, n, k] float32, zero on greedy rows). rows: (params, generator) per row; a sampled row
        draws its n uniforms from its own generator, so its drafts do not depend on the batch."""
        unary, cand = torch.topk(logits, self.top_k, dim=-1)  # [R, n, k] each
        proj = self.hidden_projection(hidden)  # [R, n, r]
        R, n = cand.shape[:2]
        dev = logits.device
        q = torch.zeros(R, n, self.top_k, dtype=torch.float32, device=dev)
        sampled = torch.tensor([not p.greedy for p, _ in rows], device=dev)  # [R]
        any_sampled = not all(p.greedy for p, _ in rows)  # from the params: no device sync per position
        if any_sampled:
            temps = torch.tensor([1.0 if p.greedy else p.temperature for p, _ in rows], device=dev)[:, None]
            u = torch.stack(
                [torch.zeros(n, device=dev) if p.greedy else torch.rand(n, generator=g, device=dev) for p, g in rows]
            )  # [R, n]
        prev, path = anchor, []
        for j in range(n):
            ctx = self.predecessor_codebook(prev) * proj[:, j]  # [R, r]
            scores = unary[:, j] + torch.einsum("br,bkr->bk", ctx, self.successor_codebook(cand[:, j]))  # [R, k]
            index = scores.argmax(-1)
            if any_sampled:
                q[:, j] = torch.softmax(scores.float() / temps, dim=-1) * sampled[:, None]
                cdf = q[:, j].cumsum(-1)  # inverse-CDF draw, as decoding/verify.sample_tokens
                drawn = torch.searchsorted(cdf, (u[:, j] * cdf[:, -1])[:, None].contiguous(), right=True)[:, 0]
                index = torch.where(sampled, drawn.clamp_(max=self.top_k - 1), index)
            prev = cand[:, j].gather(-1, index[:, None])[:, 0]
            path.append(prev)
        return torch.stack(path, dim=1), cand, q


def build(drafter) -> None:
    """Adds the convolutions (layers.i.attention_conv / mlp_conv) and the candidate selector."""
    c, f = drafter.config, drafter.config.family_fields
    for layer in drafter.layers:
        layer.attention_conv = GroupedCausalConv(c.hidden_size, f["conv_kernel_size"], f["conv_group_size"])
        layer.mlp_conv = GroupedCausalConv(c.hidden_size, f["conv_kernel_size"], f["conv_group_size"])
    drafter.candidate_selector = CandidateSelector(c.vocab_size, c.hidden_size, f["selector_rank"], f["selector_top_k"])


def load_keys(state: dict) -> dict:
    """Published layout (codebooks without `.weight`) -> state_dict names; either spelling loads."""
    rename = {f"{SELECTOR}.{name}": f"{SELECTOR}.{name}.weight" for name in CODEBOOKS}
    return {rename.get(k, k): v for k, v in state.items()}


def save_keys(state: dict) -> dict:
    """state_dict names -> the published layout (what the reference's from_pretrained maps back)."""
    rename = {f"{SELECTOR}.{name}.weight": f"{SELECTOR}.{name}" for name in CODEBOOKS}
    return {rename.get(k, k): v for k, v in state.items()}


def lengths(cfg) -> tuple[str, ...]:
    """No draft-length source: the drafts come from the selector's path, not from per-position q."""
    return ()


def propose(drafter, block: torch.Tensor, cache, rows, needs: frozenset, warp, sample):
    """As families/dflash.propose: block [R, B] -> (block with the selected path, q [R, B-1, V] or None
    when every row is greedy, {}: no confidence source, see lengths). warp and sample are
    unused: q has no top-k / top-p, and the walk draws its candidates itself."""
    hidden = drafter.draft_block(block, cache)[:, 1:]  # [R, B-1, d]
    logits = drafter.finish_logits(drafter.head_logits(hidden))  # [R, B-1, V]
    path, cand, q = drafter.candidate_selector.walk(hidden, logits, block[:, 0], rows)
    block[:, 1:] = path
    if all(p.greedy for p, _ in rows):
        return block, None, {}
    return block, torch.zeros_like(logits).scatter_(-1, cand, q), {}


# ---- training (train/objective.family_loss) ------------------------------------------------------
# No training code for DFlash 2 has been published: this objective is derived from the inference path
# above. The training forward (train/objective.drafter_train_forward) runs each layer's convolutions
# over every block's own positions, as draft_block does; the selector is trained on the walk that
# greedy decoding takes when every draft is right, i.e. with the true previous token.


def init_heads(drafter) -> None:
    """Warm start on a trained plain backbone: both convolutions the identity (base tap 1 at offset
    0, dynamic projection 0) and the selector's hidden projection small (pair scores near 0: the walk
    takes the backbone's argmax), not 0, so that every selector weight has a gradient from step 1."""
    with torch.no_grad():
        for layer in drafter.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.zero_()
                conv.base_kernel[:, 0] = 1.0
                conv.kernel_projection.weight.zero_()
        proj = drafter.candidate_selector.hidden_projection.weight  # [r, d]
        proj.normal_(0.0, 0.01 * proj.shape[1] ** -0.5)


def selector_scores(drafter, hidden: torch.Tensor, logits: torch.Tensor, prev: torch.Tensor):
    """Teacher-forced selector: hidden [M, n, d], draft logits [M, n, V], prev [M, n] the token before
    each position -> (candidates [M, n, k], scores [M, n, k]) as walk scores them when its path is prev."""
    sel = drafter.candidate_selector
    unary, cand = torch.topk(logits, sel.top_k, dim=-1)  # [M, n, k] each
    ctx = sel.predecessor_codebook(prev) * sel.hidden_projection(hidden)  # [M, n, r]
    return cand, unary + torch.einsum("mnr,mnkr->mnk", ctx, sel.successor_codebook(cand))


def _teacher_forced(drafter, hidden, block_ids, labels):
    """-> (draft logits [NJ, B-1, V], candidates [NJ, B-1, k], their scores [NJ, B-1, k]) when the walk's
    path is the labels: hidden [N, J, B, d], block_ids [N, J, B], labels [N, J, B-1]."""
    h = hidden[:, :, 1:].flatten(0, 1)  # [NJ, B-1, d]
    logits = drafter.finish_logits(drafter.head_logits(h))
    cand, scores = selector_scores(drafter, h, logits, dflash.previous_tokens(block_ids, labels))
    return logits, cand, scores


def train_logits(drafter, hidden, block_ids, labels) -> torch.Tensor:
    """What the walk's q is the softmax of (temperature 1) when its path is the labels: the candidates'
    scores on the vocabulary, -inf elsewhere. hidden [N, J, B, d], block_ids [N, J, B], labels
    [N, J, B-1] -> [N, J, B-1, V] float32."""
    logits, cand, scores = _teacher_forced(drafter, hidden, block_ids, labels)
    full = torch.full_like(logits, float("-inf")).scatter_(-1, cand, scores)
    return full.view(*labels.shape, -1)


def train_terms(drafter, hidden, block_ids, labels, teacher=None, selector_alpha: float = 1.0):
    """hidden [N, J, B, d] of the training forward, block_ids [N, J, B], labels [N, J, B-1] (tokens of
    block positions 1..B-1) -> ([(alpha, per-position loss [N, J, B-1])], greedy drafts [N, J, B-1]).
    Per position k: CE(draft logits_k, label_k) (as plain DFlash) + selector_alpha * CE over the k
    candidates' scores with the label's candidate as target, when the label is among the top-k
    (otherwise that position has the first term only); the scores' previous token is the true one.
    teacher is unused."""
    logits, cand, scores = _teacher_forced(drafter, hidden, block_ids, labels)
    shape, flat = labels.shape, labels.flatten(0, 1)
    base = F.cross_entropy(logits.flatten(0, 1), flat.flatten(), reduction="none").view(shape)
    hit = cand == flat[..., None]  # [NJ, B-1, k]
    found = hit.any(-1)
    sel = F.cross_entropy(scores.flatten(0, 1), hit.float().argmax(-1).flatten(), reduction="none")
    sel = torch.where(found.flatten(), sel, torch.zeros_like(sel)).view(shape)
    predicted = cand.gather(-1, scores.argmax(-1, keepdim=True))[..., 0].view(shape)
    return [(1.0, base), (selector_alpha, sel)], predicted


# ---- deploy capabilities (families/capabilities.py; read by deploy/ and the engine switches) ----------------
# vLLM 0.33 runs it under method dflash (architecture DFlash2DraftModel); its convolutions' kernel_projection
# takes the draft's quant_config (model_executor/models/qwen3_dflash2.py:194-201), so an unquantized one
# must be in exclude_modules; the selector's hidden_projection has none (:332-337).
# SGLang 0.5.23: DFlash2DraftModel subclasses DFlashDraftModel (srt/models/dflash.py:1264), whose
# supports_quantization is False (:685). TensorRT-LLM's speculative_config has no DFlash 2.
CAPS = Capabilities(
    engines={
        "vllm": EngineSupport("dflash", quantized_drafter=True, source="qwen3_dflash2.py:194-201,332-337"),
        "sglang": EngineSupport("DFLASH", source="srt/models/dflash.py:685,1264"),
        "torch": EngineSupport("dflash", quantized_drafter=True),
    },
    refused={
        "trtllm-pytorch": (
            "TensorRT-LLM has no DFlash 2 drafter (its speculative_config takes DFlash or DSpark); vLLM runs it "
            "(backend: torch with emit: [vllm] writes its command), and dflash-trt's torch backend runs every family"
        )
    },
    quant_exclude=(*ALWAYS_EXCLUDED, "*kernel_projection", f"{SELECTOR}*"),
    draft_cutoff=False,  # lengths() offers no per-draft probability
    hybrid=False,
)
