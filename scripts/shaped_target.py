"""Write a target of a real model's shape with random bf16 weights, streamed to disk in safetensors shards.

Used to measure `dflash-trt build` at the size DFlash is for (docs/deploy.md, "Quantizing large targets")
and by tests/test_build_memory.py on a smaller shape. Each tensor is generated and written on its own
(the safetensors header is computed from the shapes first), so writing a 16 GB checkpoint needs about one
tensor of memory; a tokenizer folder's files are copied in, so the folder builds as it is.

    python scripts/shaped_target.py OUT --shape qwen3-8b --tokenizer TOKENIZER_FOLDER
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import struct
from pathlib import Path

import torch

# Qwen/Qwen3-8B's config.json (the fields transformers' Qwen3Config reads)
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "attention_bias": False,
}
# a few hundred MB with the decoder layers (not the embeddings) the largest modules, as in an 8B model
# (embedding / decoder layer = 2.8, Qwen3-8B's is 3.2): 12 layers of 24 MB + two 67 MB embeddings = 420 MB
SMALL = {**QWEN3_8B, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 12}
SMALL.update(num_attention_heads=8, num_key_value_heads=2, head_dim=128, vocab_size=32768, bos_token_id=1)
SMALL.update(eos_token_id=2)
SHAPES = {"qwen3-8b": QWEN3_8B, "small": SMALL}


def tensor_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """name -> shape of a Qwen3 decoder-only checkpoint."""
    d, f, hd, V = c["hidden_size"], c["intermediate_size"], c["head_dim"], c["vocab_size"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    out = {"model.embed_tokens.weight": (V, d)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update(
            {
                p + "input_layernorm.weight": (d,),
                p + "post_attention_layernorm.weight": (d,),
                p + "self_attn.q_proj.weight": (q, d),
                p + "self_attn.k_proj.weight": (kv, d),
                p + "self_attn.v_proj.weight": (kv, d),
                p + "self_attn.o_proj.weight": (d, q),
                p + "self_attn.q_norm.weight": (hd,),
                p + "self_attn.k_norm.weight": (hd,),
                p + "mlp.gate_proj.weight": (f, d),
                p + "mlp.up_proj.weight": (f, d),
                p + "mlp.down_proj.weight": (d, f),
            }
        )
    out["model.norm.weight"] = (d,)
    if not c["tie_word_embeddings"]:
        out["lm_head.weight"] = (V, d)
    return out


def largest_layer_bytes(c: dict) -> int:
    """bf16 bytes of the largest module: one decoder layer, the embedding or the LM head."""
    shapes = tensor_shapes(c)
    layer = sum(math.prod(s) for k, s in shapes.items() if k.startswith("model.layers.0."))
    return 2 * max(layer, c["vocab_size"] * c["hidden_size"])


def _random(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if len(shape) == 1:  # norms: ones, as initialised
        return torch.ones(shape, dtype=torch.bfloat16)
    return (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)


def write_shards(out: Path, shapes: dict[str, tuple[int, ...]], shard_bytes: int, seed: int = 0) -> list[str]:
    """model-0000i-of-0000n.safetensors + model.safetensors.index.json; one tensor in memory at a time."""
    groups, cur, size = [], [], 0
    for k, s in shapes.items():
        n = 2 * math.prod(s)
        if cur and size + n > shard_bytes:
            groups.append(cur)
            cur, size = [], 0
        cur.append(k)
        size += n
    groups.append(cur)
    gen, index, files = torch.Generator().manual_seed(seed), {}, []
    for i, names in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        header, off = {}, 0
        for k in names:
            n = 2 * math.prod(shapes[k])
            header[k] = {"dtype": "BF16", "shape": list(shapes[k]), "data_offsets": [off, off + n]}
            off += n
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes
        with open(out / fname, "wb") as fh:
            fh.write(struct.pack("<Q", len(raw)) + raw)
            for k in names:
                fh.write(_random(k, shapes[k], gen).view(torch.uint16).numpy().tobytes())
        index.update({k: fname for k in names})
        files.append(fname)
    total = sum(2 * math.prod(s) for s in shapes.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=2)
    )
    return files


def make(out: Path, config: dict, tokenizer: Path | None, shard_gb: float = 5.0, seed: int = 0) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    write_shards(out, tensor_shapes(config), int(shard_gb * 1e9), seed)
    if tokenizer is not None:
        for f in tokenizer.iterdir():
            if f.is_file() and f.name not in ("config.json", "model.safetensors", "generation_config.json"):
                shutil.copyfile(f, out / f.name)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    ap.add_argument("--tokenizer", type=Path, default=None, help="folder whose tokenizer files are copied in")
    ap.add_argument("--shard-gb", type=float, default=5.0)
    a = ap.parse_args()
    make(a.out, SHAPES[a.shape], a.tokenizer, a.shard_gb)
    print(a.out)


if __name__ == "__main__":
    main()
