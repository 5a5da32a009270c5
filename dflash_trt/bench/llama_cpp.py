"""The `llama-cpp` bench method: llama.cpp's plain decoding of the same weights, through llama-cpp-python.

Boundary: one generation per call like every method (bench/methods.py), plus the one conversion it
needs. Our target is a Hugging Face folder made from a GGUF (hub/models.py: dequantised, rounded to
bfloat16); llama.cpp needs a GGUF. `f32_gguf` rebuilds that GGUF with every tensor stored as F32
holding exactly the HF folder's values (dequantise with gguf-py as transformers did, round to
bfloat16 as the hub did, store as float32), the metadata (tokenizer, RoPE, norms) copied as is.
So `--dtype float32 --methods baseline,llama-cpp` compares two engines on identical fp32 weights
and threads (llama.cpp gets torch.get_num_threads(), which `bench --threads` sets).

Skipped with a reason (never faked): llama-cpp-python not installed (PyPI ships it as source only:
`pip install llama-cpp-python` builds llama.cpp, needing cmake and a C++ compiler), a target that is
not a known hub model (no source GGUF), a dtype other than float32, a device other than the CPU, or
sampling (the method decodes greedily). Greedy tokens may differ from ours at near-ties (another
engine's fp32 kernels), so the method is not `lossless`: the bench reports it, never fails on it.
"""

from __future__ import annotations

import importlib.util
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from dflash_trt.atomic import atomic_dir
from dflash_trt.bench.methods import Method, MethodUnavailable, Run, register
from dflash_trt.hub.models import KNOWN_MODELS, assemble_gguf, models_home

FILE = "model-f32.gguf"


def unavailable_reason(target_name: str, dtype: torch.dtype, device: torch.device | str, greedy: bool) -> str | None:
    """Why the llama-cpp method cannot run for this bench (None: it can)."""
    if importlib.util.find_spec("llama_cpp") is None:
        return (
            "llama-cpp-python is not installed (pip install llama-cpp-python: PyPI has source only, "
            "the build needs cmake and a C++ compiler)"
        )
    if str(target_name) not in KNOWN_MODELS:
        return f"target {target_name!r} is not a known hub model, so there is no source GGUF to convert"
    if dtype != torch.float32:
        return f"dtype {dtype}: compare with llama.cpp at the same precision, --dtype float32"
    if torch.device(device).type != "cpu":
        return f"device {device}: the method runs llama.cpp's CPU build"
    if not greedy:
        return "temperature > 0: the method decodes greedily only"
    return None


def rewrite_f32(src: Path, dst: Path) -> int:
    """Write GGUF `src` to `dst` with every tensor as F32 holding its bfloat16-rounded dequantised values
    (the values hub/models.py saved into the HF folder). Returns the number of tensors."""
    # deferred: gguf-py is only needed for this one-off conversion
    import gguf

    reader = gguf.GGUFReader(src)
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == gguf.Keys.General.FILE_TYPE:
            value = int(gguf.LlamaFileType.ALL_F32)
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    tensors = []
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type)  # float32, numpy (logical) shape
        values = torch.from_numpy(np.array(values, dtype=np.float32)).to(torch.bfloat16).float().numpy()
        tensors.append((t.name, values))
        writer.add_tensor_info(t.name, values.shape, values.dtype, values.nbytes, gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, values in tensors:
        writer.write_tensor_data(values)
    writer.close()
    return len(tensors)


def f32_gguf(name: str, home: str | Path | None = None, progress: bool = True) -> Path:
    """`<home>/gguf/<name>/model-f32.gguf`, built once from the model's source GGUF (idempotent)."""
    final = (Path(home).expanduser() if home else models_home()) / "gguf" / name
    if (final / FILE).is_file():
        return final / FILE
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{name}.src-", dir=final.parent) as work, atomic_dir(final) as out:
        rewrite_f32(assemble_gguf(name, Path(work), progress), out / FILE)
    return final / FILE


def _next_token(llm) -> int:
    """Greedy pick from the last evaluated token's logits. Read from the context: llama-cpp-python
    0.3.x fills `llm.scores` only with logits_all=True (it samples inside llama.cpp otherwise)."""
    return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))


@register
class LlamaCpp(Method):
    """llama.cpp's plain greedy decoding: prompt evaluated in one batch, then one eval() per token."""

    name = "llama-cpp"
    lossless = False

    def prepare(self):
        ctx = self.ctx
        reason = unavailable_reason(ctx.cfg.target, ctx.target.dtype, ctx.device, ctx.cfg.temperature == 0)
        if reason:
            raise MethodUnavailable(reason)
        # deferred: optional dependency, checked above
        from llama_cpp import Llama

        threads = torch.get_num_threads()
        self.llm = Llama(
            model_path=str(f32_gguf(ctx.cfg.target)),
            n_ctx=ctx.max_seq_len,
            n_batch=512,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
        )

    def run(self, item, params):
        llm, stops = self.llm, self.ctx.stops
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(item.ids)
        tok = _next_token(llm)
        ttft = time.perf_counter() - t0
        toks = [tok]
        while len(toks) < params.max_new_tokens and tok not in stops:
            llm.eval([tok])
            tok = _next_token(llm)
            toks.append(tok)
        wall = time.perf_counter() - t0
        return Run(toks, len(toks), ttft, wall, [0, len(toks) - 1], verify_time=wall - ttft)

    def close(self):
        if getattr(self, "llm", None) is not None:
            self.llm.close()
            self.llm = None
