"""Speculative decoding: the draft -> verify -> accept -> rewind loop over a live batch.

  engine.py        SpecEngine: per-request state, continuous batching, the named loop phases
  loop.py          generate() / generate_baseline(): batch entry points over SpecEngine
  verify.py        greedy acceptance and lossless rejection sampling (pure tensors)
  draft_length.py  confidence-gated draft length (--draft-cutoff)
"""
