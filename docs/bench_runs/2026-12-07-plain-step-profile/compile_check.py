import time, torch, torch.nn.functional as F
torch.set_num_threads(1)
w = torch.randn(576); W = torch.randn(1536, 576)
def f(x):
    h = F.rms_norm(x, (576,), w, 1e-5)
    return F.silu(F.linear(h, W)) * 2 + 1
x = torch.randn(1, 1, 576)
t0 = time.time(); c0 = time.process_time()
g = torch.compile(f)
y = g(x)
print("compile+first call wall s", round(time.time() - t0, 1), "cpu s", round(time.process_time() - c0, 1))
print("max |diff| vs eager", (y - f(x)).abs().max().item())
for fn, name in ((f, "eager"), (g, "compiled")):
    c = time.process_time()
    for _ in range(200): fn(x)
    print(name, "cpu us/call", round((time.process_time() - c) / 200 * 1e6, 1))
