"""The serving copy of a drafter for vLLM / SGLang: serve/<engine>/drafter/ in the layout that engine loads.

Boundary: one drafter folder in, one engine's folder out (config.json, model.safetensors and, for a
quantized drafter, hf_quant_config.json); the command lines and the refusals are deploy/emit.py's.
Why a copy at all: dflash-trt's own checkpoint extensions do not load as they are. vLLM 0.33 maps
every tensor not named lm_head to `model.<name>` and refuses one with no module (`draft_vocab`:
"There is no module or parameter named ..."), SGLang 0.5.23 skips unknown tensors silently
(models/dflash.py DFlashDraftModel.load_weights: "Ignore unexpected weights"), and both read the
DSpark head fields at the top level of config.json. What each engine gets (sources in the wheels):

  config.json   the drafter's config as dflash-trt normalises it (defaults filled in: SGLang defaults
                confidence_head_with_markov to markov_rank > 0, models/dspark.py:497, so it is always
                written), plus
                * the family's CAPS.top_level fields also top-level (DSpark: markov_rank, markov_head_type,
                  enable_confidence_head, confidence_head_with_markov and sample_from_anchor: vLLM
                  models/qwen3_dspark.py:209-224, v1/worker/gpu/spec_decode/dspark/speculator.py:49-51;
                  SGLang models/dspark.py:385-405, 487-507); EngineSupport.top_level_only fields only there
                  (vLLM's DFlashSpeculator refuses dflash_config.sample_from_anchor=true: DSpark's is top level);
                * an engine that runs the family under another class (CAPS EngineSupport.architecture;
                  Domino on SGLang): architectures [DFlashDraftModel], dflash_config.projector_type
                  "domino" (SGLang has no DominoDraftModel class: speculative/dflash_utils.py:727-790);
                * a draft vocabulary: vLLM `draft_vocab_size` top-level (models/qwen3_dflash.py:745-775),
                  SGLang none (it has no draft vocabulary; the drafter drafts over the whole vocabulary
                  through the target's LM head, as dflash-trt's portable checkpoints do);
                * a quantized drafter keeps `quantization_config` (vLLM detects Model Optimizer checkpoints
                  from it: config/model.py:1383-1460); deploy/emit.py hands an engine the quantized drafter
                  only where the family's CAPS says its loader reads one (SGLang never: the bf16 copy).
  tensors       the family's published names (families/*.save_keys; DSpark's legacy `logit_head.` nesting
                removed: neither engine maps it), without `draft_vocab`; for vLLM a draft vocabulary
                becomes EAGLE-3's representation: `lm_head.weight` = the target LM head's rows of those
                tokens and `d2t` = token id - draft id (models/qwen3_dflash.py:851-884, compute_logits
                806-815), since the drafter's logits ARE those rows of the shared head.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflash_trt.config import DrafterConfig
from dflash_trt.deploy.files import link_or_copy, read_state
from dflash_trt.errors import CheckpointError
from dflash_trt.families.capabilities import caps_of, engine_of

ENGINES = ("vllm", "sglang")
DROPPED = ("draft_vocab",)  # dflash-trt's own tensors; written back in the engine's form where it has one
QUANT_FILE = "hf_quant_config.json"


def serving_config(src: Path, dc: DrafterConfig, engine: str) -> dict:
    """config.json of the serving copy of the drafter in `src` (its config dc) for `engine` (vllm | sglang)."""
    raw = json.loads((src / "config.json").read_text())
    out = dc.to_json_dict(portable=True)  # normalised family fields; no draft_vocab_size
    if "quantization_config" in raw:
        out["quantization_config"] = raw["quantization_config"]
    fam, fields = dc.family, dc.family_fields
    out.update({k: fields[k] for k in caps_of(fam).top_level})
    support = engine_of(fam, engine)
    for k in support.top_level_only:  # this engine refuses them inside dflash_config
        out["dflash_config"].pop(k, None)
    arch = support.architecture
    if arch is not None:  # the engine runs the family under another class, told apart by projector_type
        out["architectures"] = [arch]
        out["dflash_config"]["projector_type"] = fam.PROJECTOR_TYPE
    if dc.draft_vocab_size is not None and support.draft_vocab:
        out["draft_vocab_size"] = dc.draft_vocab_size
    return out


def target_head_rows(target: Path, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the target's LM head (its input embedding when the two are tied), read from the
    safetensors of `target` one tensor at a time (a target's shards are never loaded whole)."""
    names: dict[str, Path] = {}
    for f in sorted(target.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            names.update({k: f for k in fh.keys()})
    for suffix in ("lm_head.weight", "embed_tokens.weight"):
        hits = sorted((k for k in names if k == suffix or k.endswith("." + suffix)), key=len)
        if hits:
            with safe_open(str(names[hits[0]]), framework="pt") as fh:
                return fh.get_tensor(hits[0]).index_select(0, ids).contiguous()
    raise CheckpointError(f"target {target}: no lm_head.weight or embed_tokens.weight tensor for the draft vocabulary")


def serving_state(
    weights: dict[str, torch.Tensor], dc: DrafterConfig, engine: str, target: Path
) -> dict[str, torch.Tensor]:
    """The tensors of the serving copy (see the module docstring), from the drafter's own weights."""
    fam = dc.family
    state = fam.save_keys(fam.load_keys(weights))
    vocab = state.get("draft_vocab")
    state = {k: v.contiguous() for k, v in state.items() if k not in DROPPED}
    if vocab is not None and engine_of(dc.family, engine).draft_vocab:
        ids = vocab.to(torch.int64)
        state["lm_head.weight"] = target_head_rows(target, ids)
        state["d2t"] = ids - torch.arange(len(ids), dtype=torch.int64)  # vLLM: target id = draft id + d2t
    return state


def write_serving_drafter(src: Path, dst: Path, engine: str, target: Path) -> dict:
    """Write dst/ (config.json, model.safetensors[, hf_quant_config.json]) for `engine`; returns what
    changed relative to the source, for the build log and build.json."""
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r}: one of {', '.join(ENGINES)}")
    dst.mkdir(parents=True, exist_ok=True)
    dc, weights, files = DrafterConfig.load(src), read_state(src, "drafter "), sorted(src.glob("*.safetensors"))
    original = set(weights)
    state = serving_state(weights, dc, engine, target)
    if set(state) == original and len(files) == 1:
        link_or_copy(files[0], dst / "model.safetensors")  # nothing to rename: hard-link the weights
    else:
        save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(serving_config(src, dc, engine), indent=2, sort_keys=True) + "\n")
    if (src / QUANT_FILE).is_file():
        shutil.copyfile(src / QUANT_FILE, dst / QUANT_FILE)
    return {
        "dropped": sorted(original - set(state)),
        "added": sorted(set(state) - original),
        "tensors": len(state),
    }
