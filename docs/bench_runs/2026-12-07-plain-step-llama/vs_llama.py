import time, torch, numpy as np, sys
from llama_cpp import Llama
from dflash_trt.api import load_target
from dflash_trt.bench.llama_cpp import f32_gguf, _next_token
torch.set_num_threads(1)
name = sys.argv[1]
t, _ = load_target(name, dtype="float32", progress=False, packed=False)
llm = Llama(model_path=str(f32_gguf(name, progress=False)), n_ctx=512, n_threads=1, n_threads_batch=1, verbose=False)
prompt = list(range(1, 101))
cache = t.new_cache(1, 512)
tok = t.prefill([prompt], cache).logits[:, -1].argmax(-1)
llm.reset(); llm.eval(prompt); ltok = _next_token(llm)
print("first token ours", int(tok), "llama.cpp", ltok)
def ours():
    global tok
    for _ in range(4):
        tok = t.forward(tok[:, None], cache).logits[:, -1].argmax(-1)
def llama():
    global ltok
    for _ in range(4):
        llm.eval([ltok]); ltok = _next_token(llm)
res = {"ours-dense": [], "llama.cpp": []}
for r in range(4):
    for k, f in (("ours-dense", ours), ("llama.cpp", llama)):
        c = time.process_time(); w = time.perf_counter(); f()
        res[k].append(((time.process_time() - c) / 4 * 1e3, (time.perf_counter() - w) / 4 * 1e3))
for k, v in res.items():
    print(k, "cpu ms/token", sorted(round(a, 1) for a, _ in v), "wall", sorted(round(b) for _, b in v))
