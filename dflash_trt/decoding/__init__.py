"""Speculative decoding: the draft -> verify -> accept -> rewind loop over a live batch.

engine.py        SpecEngine: per-request state, continuous batching, the named loop phases
loop.py          generate() / generate_baseline(): batch entry points over SpecEngine
verify.py        greedy acceptance and lossless rejection sampling (pure tensors)
draft_length.py  confidence-gated draft length (--draft-cutoff)
stats.py         DecodeStats: per-request and batch statistics, the one definition of tau
stopping.py      StopRule: when a row is finished and where its tokens are cut
prompt.py        check_prompt: the one validation of a prompt's token ids
"""
