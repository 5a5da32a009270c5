"""The serving engine factory: load target + drafter once, make SpecEngines over them.

Boundary: the folders and options of the engine model's config.pbtxt -> a zero-argument factory the
Orchestrator (serving/orchestrator.py) calls at start and after an engine failure.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

from dflash_trt.errors import DFlashError


def load_engine_factory(
    target_dir: str,
    drafter_dir: str,
    engine_backend: str = "torch",
    max_batch: int = 16,
    max_seq_len: int = 2048,
    dtype: str = "auto",
    draft_cutoff: float | None = None,
    draft_length: str | None = None,
    proposer: str | None = None,
) -> Callable[[], object]:
    """Load target + drafter once; return a factory of SpecEngines over them (a fresh one after a
    failure). Missing or mismatched folders raise DFlashError naming the file; a proposer the engine
    refuses (decoding/engine.py) fails at the first engine (Orchestrator(factory)). draft_cutoff,
    draft_length, proposer: EngineOptions fields (decoding/options.py; None: its default). The engines share
    one Session (decoding/session.py), so that a fresh engine after a failure keeps what was learned."""
    if engine_backend != "torch":
        raise DFlashError(
            f"engine_backend={engine_backend!r}: only 'torch' is available in this build "
            f"(TensorRT-LLM engines are served by their own backend)"
        )
    if max_batch < 1 or max_seq_len < 2:
        raise DFlashError(f"max_batch={max_batch}, max_seq_len={max_seq_len}: must be >= 1 and >= 2")
    # deferred: the Triton text models import this module (through triton_dflash) and must not load torch and the engine
    from dflash_trt.api import load_drafter, load_target
    from dflash_trt.decoding.engine import SpecEngine
    from dflash_trt.decoding.options import EngineOptions
    from dflash_trt.decoding.session import Session

    # cuda_graph off: under continuous batching the rows change almost every step and each change
    # would recapture the graph (modeling/cuda_graph.py), costing more than replay saves
    options = EngineOptions.of(
        cuda_graph="off", draft_cutoff=draft_cutoff, draft_length=draft_length, proposer=proposer
    )

    target_dir, drafter_dir = Path(target_dir), Path(drafter_dir)
    if not (target_dir / "config.json").is_file():
        raise DFlashError(f"target_dir: {target_dir / 'config.json'} not found (expected a Hugging Face model folder)")
    if not (drafter_dir / "config.json").is_file():
        raise DFlashError(f"drafter_dir: {drafter_dir / 'config.json'} not found (expected a DFlash drafter folder)")
    # pipeline's loaders also read FP8/NVFP4 (Model Optimizer layout) folders, dequantised on load
    target = load_target(str(target_dir), dtype, progress=False)[0]
    drafter = load_drafter(target, str(drafter_dir)).eval()
    return functools.partial(
        SpecEngine, target, drafter, max_batch=max_batch, max_seq_len=max_seq_len, options=options, session=Session()
    )
