"""Serving DFlash with NVIDIA Triton Inference Server (Python backend).

Model repository (templates in model_repo/, filled by repo.fill_model_repo):

  dflash          engine model (decoupled; unary in `decoupled: false` builds): token ids in, output ids + acceptance
                  statistics out; one background thread runs continuous batching
                  (orchestrator.py) over SpecEngine; custom dflash_* metrics.
  dflash_bls      decoupled text front door (gRPC streaming API): tokenizes in-process, drives
                  `dflash` through BLS, detokenises incrementally, propagates cancellation.
  dflash_unary    the same front door, not decoupled: unary gRPC `infer` and HTTP clients; each
                  request answered when it is done, batched requests served row by row.
  ensemble        preprocessing -> dflash -> postprocessing with tensorrtllm_backend's inputs
                  (unary over a unary `dflash` in `decoupled: false` builds).
  preprocessing / postprocessing   the ensemble's tokenizer steps.

Why three text front doors (measured on Triton 2.51): an ensemble that contains a decoupled
step is itself decoupled, so unary `infer` rejects it ("ModelInfer RPC doesn't support models
with decoupled transaction policy"); a client's cancellation does not reach a running
ensemble step, so a disconnected stream would run to max_tokens; and an ensemble step may not
mix ensemble inputs with a decoupled step's outputs. Hence streaming clients use `dflash_bls`,
unary clients `dflash_unary`, and `ensemble` stays for tensorrtllm_backend-style clients.
All three return the same text: streamed chunks concatenate exactly to the non-streamed text.

Modules: server.py (start/stop tritonserver, clean shutdown), serve_loop.py (`dflash-trt serve`'s
loop and signals), triton_env.py (the binary, the backend's environment, endpoint addresses),
triton_log.py (reading Triton's stop: unloads stuck with nothing in flight), drain.py (the drain file
that tells the engine model to finish within a grace period), repo.py (fill templates), client.py
(DFlashClient), text.py (tokenizer, exact incremental detokenisation), stops.py (text stop
strings), protocol.py (request validation, tensors), trtllm_inputs.py (tensorrtllm_backend's
optional inputs), orchestrator.py (step loop), jobs.py (its per-request state, sinks, metrics
hooks), engine_factory.py (load the pair, make engines), openai_api.py / openai_schema.py /
openai_guard.py (the OpenAI-compatible HTTP API in front of the server; API key, body bounds),
triton_dflash.py / triton_text.py (the Python-backend models; importable only inside Triton's stub).
"""
