"""The models the decoding loop drives: target adapter, DFlash drafter, caches, CPU/GPU fast paths.

target.py      target adapter: prefill / verify, logits + tapped hidden states
drafter.py     DFlash drafter (context fusion, KV injection, block drafting)
cache.py       KV cache with per-row lengths, cropped by setting lengths
cpu_pack.py    oneDNN-packed linear weights for CPU inference
fast_path.py   dispatch of drafter/acceptance onto the OpenAI-Triton kernels on CUDA
cuda_graph.py  the drafter step replayed from a CUDA graph
"""
