"""Speculative decoding: the draft -> verify -> accept -> rewind loop over a live batch.

engine.py        SpecEngine: per-request state, continuous batching, the named loop phases
loop.py          generate() / generate_baseline(): batch entry points over SpecEngine
verify.py        greedy acceptance and lossless rejection sampling (pure tensors)
draft_length.py  which draft length an engine runs; confidence-gated length (--draft-cutoff)
verify_cost.py   cost-aware length (--draft-length cost): the measured verify cost, the best width
proposal.py      a round's Proposal, the proposer / length plan and its refusals, copies-only rounds
ngram.py         SuffixIndex: a request's copied continuations (suffix automaton)
hybrid.py        the hybrid proposer's choice between a copy and the drafter's block
tree.py          the tree proposer: copy and drafter block verified in one tree-masked pass
stats.py         DecodeStats: per-request and batch statistics, the one definition of tau
stopping.py      StopRule: when a row is finished and where its tokens are cut
prompt.py        check_prompt: the one validation of a prompt's token ids
penalties.py     logit controls (penalties, min_tokens, bad words) per verify-block position
"""
