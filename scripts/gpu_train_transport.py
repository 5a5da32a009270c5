"""The weight transport of scripts/gpu_train_run.py: a target's safetensors weights quantized per group
of GROUP weights to k bits with an fp16 scale, cut into parts that each fit one device call (`pack`,
run here), and put back together as a bf16 safetensors folder on the GPU machine (`unpack`).

Only the bytes and their index live here; what the run does with the unpacked target (data, training,
eval, shipping the drafter back) stays in gpu_train_run.py, which imports this module from its own
folder (scripts/) and re-exports its names (tests/test_gpu_train_run.py reaches them through it).
"""

from __future__ import annotations

import json
import lzma
import math
from pathlib import Path

import torch

GROUP = 64


# ---- k-bit group quantization for transport ----------------------------------------------------
def quantize(w: torch.Tensor, bits: int) -> tuple[bytes, torch.Tensor]:
    """w [..] -> (packed codes, fp16 scales [n/GROUP]); codes in [-q, q], q = 2^(bits-1) - 1, stored
    offset by 2^(bits-1) and bit-packed little-endian; numel must be a multiple of GROUP."""
    q = 2 ** (bits - 1) - 1
    g = w.float().reshape(-1, GROUP)
    scale = (g.abs().amax(1) / q).clamp_min(1e-12).half()
    codes = torch.round(g / scale.float()[:, None]).clamp(-q, q).to(torch.int64) + 2 ** (bits - 1)
    flat = codes.reshape(-1, 8)  # 8 codes -> `bits` bytes
    word = torch.zeros(flat.shape[0], dtype=torch.int64)
    for i in range(8):
        word |= flat[:, i] << (bits * i)
    out = torch.stack([(word >> (8 * j)) & 0xFF for j in range(bits)], 1).to(torch.uint8)
    return out.numpy().tobytes(), scale


def dequantize(buf: bytes, scale: torch.Tensor, shape: list[int], bits: int, device) -> torch.Tensor:
    raw = torch.frombuffer(bytearray(buf), dtype=torch.uint8).to(device).reshape(-1, bits).to(torch.int64)
    word = torch.zeros(raw.shape[0], dtype=torch.int64, device=device)
    for j in range(bits):
        word |= raw[:, j] << (8 * j)
    mask = 2**bits - 1
    codes = torch.stack([(word >> (bits * i)) & mask for i in range(8)], 1).reshape(-1, GROUP)
    vals = (codes - 2 ** (bits - 1)).float() * scale.to(device).float()[:, None]
    return vals.reshape(shape).to(torch.bfloat16)


def pack(model: Path, out: Path, bits: int, part_mb: float) -> None:
    from safetensors import safe_open

    out.mkdir(parents=True, exist_ok=True)
    index, blob = [], bytearray()
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            entry = {"name": name, "shape": list(t.shape), "offset": len(blob)}
            if t.dim() == 2 and t.numel() % (8 * GROUP) == 0:
                codes, scale = quantize(t, bits)
                entry.update(kind="q", nbytes=len(codes), scale_offset=len(blob) + len(codes))
                blob += codes
                blob += scale.numpy().tobytes()
            else:  # norms and biases: small, sent as bf16
                raw = t.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
                entry.update(kind="bf16", nbytes=len(raw))
                blob += raw
            index.append(entry)
    (out / "side").mkdir(exist_ok=True)  # config and tokenizer files, xz-compressed (carried with any part)
    for f in sorted(model.iterdir()):
        if f.is_file() and not f.name.startswith(("model", ".")):  # weights travel in the parts
            (out / "side" / (f.name + ".xz")).write_bytes(lzma.compress(f.read_bytes()))
    step = int(part_mb * 2**20)
    parts = math.ceil(len(blob) / step)
    for i in range(parts):
        d = out / f"p{i:02d}"
        d.mkdir(exist_ok=True)
        (d / "blob").write_bytes(bytes(blob[i * step : (i + 1) * step]))
    (out / "side" / "index.json").write_text(
        json.dumps({"bits": bits, "parts": parts, "size": len(blob), "tensors": index})
    )
    print(f"{len(blob) / 2**20:.0f} MiB in {parts} parts of <= {part_mb} MiB under {out}")


def unpack(parts: Path, dest: Path, device) -> Path:
    from safetensors.torch import save_file

    meta = json.loads((parts / "side" / "index.json").read_text())
    missing = [i for i in range(meta["parts"]) if not (parts / f"p{i:02d}" / "blob").is_file()]
    if missing:
        raise SystemExit(f"{parts}: parts {missing} of {meta['parts']} are missing (each device call carries one)")
    blob = b"".join((parts / f"p{i:02d}" / "blob").read_bytes() for i in range(meta["parts"]))
    assert len(blob) == meta["size"], (len(blob), meta["size"])
    state = {}
    for e in meta["tensors"]:
        raw = blob[e["offset"] : e["offset"] + e["nbytes"]]
        if e["kind"] == "q":
            n = math.prod(e["shape"]) // GROUP
            scale = torch.frombuffer(
                bytearray(blob[e["scale_offset"] : e["scale_offset"] + 2 * n]), dtype=torch.float16
            )
            state[e["name"]] = dequantize(raw, scale, e["shape"], meta["bits"], device).cpu()
        else:
            state[e["name"]] = (
                torch.frombuffer(bytearray(raw), dtype=torch.int16).view(torch.bfloat16).reshape(e["shape"])
            )
    dest.mkdir(parents=True, exist_ok=True)
    save_file(state, str(dest / "model.safetensors"), metadata={"format": "pt"})
    for f in (parts / "side").glob("*.xz"):
        (dest / f.name[:-3]).write_bytes(lzma.decompress(f.read_bytes()))
    return dest
