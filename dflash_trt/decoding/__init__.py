"""Speculative decoding: the draft -> verify -> accept -> rewind loop over a live batch.

engine.py        SpecEngine: per-request state, continuous batching, the named loop phases
loop.py          generate() / generate_baseline(): batch entry points over SpecEngine
verify.py        greedy acceptance and lossless rejection sampling (pure tensors)
draft_length.py  which draft length an engine runs; confidence-gated length (--draft-cutoff)
verify_cost.py   the measured verify cost, the best width (--draft-length cost), the pay gate
options.py       EngineOptions: proposer, draft length and cutoff, kernels, CUDA graph (validated once)
proposers/       one module per proposer (dflash, ngram, hybrid, tree, none) behind base.py's Proposer,
                 the registry and the proposer / length plan with its refusals (__init__.py)
proposal.py      a round's Proposal, copies-only rounds, the cut to the most profitable width
records.py       learned state: a request's copy record, the drafter's record and history
session.py       Session: the records and verify cost curves engines share when the caller wants
context_queue.py the drafter's queue of target features not yet injected (lazy upkeep)
ngram.py         SuffixIndex: a request's copied continuations (suffix automaton)
tree.py          token trees: layout, tree-masked verify and the branch choice
stats.py         DecodeStats: per-request and batch statistics, the one definition of tau
stopping.py      StopRule: when a row is finished and where its tokens are cut
prompt.py        check_prompt: the one validation of a prompt's token ids
penalties.py     logit controls (penalties, min_tokens, bad words) per verify-block position
"""
