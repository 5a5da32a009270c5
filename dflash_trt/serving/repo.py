"""Fill the model-repository templates (`model_repo/`) into a Triton model repository.

Boundary: files only. Templates use tensorrtllm_backend's `fill_template.py` style: `${name}`
placeholders in config.pbtxt files; every other file (model.py, version folders) is copied as is.
`fill_model_repo` refuses to write a repository with an unfilled placeholder (the error names
each missing one and its file), writes into a temp folder beside the destination and renames it
into place, so a failed fill never leaves a half-written repository.

`RepoInfo.read` reads back what the OpenAI API needs from a filled repository (its front door, tokenizer,
target and context length).

Placeholders: target_dir, drafter_dir, tokenizer_dir, engine_backend, max_batch, max_seq_len,
dtype, apply_chat_template, triton_max_batch_size, unary_instance_count, cpu_threads,
draft_cutoff, draft_length, proposer, max_queue, decoupled (`default_values()`).
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from dflash_trt.atomic import atomic_dir
from dflash_trt.decoding.options import DEFAULT_PROPOSER
from dflash_trt.errors import DFlashError
from dflash_trt.serving.jobs import DEFAULT_MAX_QUEUE
from dflash_trt.serving.text import read_chat_template

PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
TEMPLATE_SUFFIXES = (".pbtxt",)


def default_template_dir() -> Path:
    """The model_repo templates shipped inside the package (the checkout's top-level model_repo/ is a
    link to them, so source checkouts, editable and wheel installs all see the same files)."""
    p = Path(__file__).resolve().parent / "model_repo"
    if not p.is_dir():
        raise DFlashError(
            f"{p}: model_repo templates not found (broken install?); reinstall dflash-trt or "
            f"pass the template folder explicitly"
        )
    return p


def default_values(
    target_dir: str | Path,
    drafter_dir: str | Path,
    tokenizer_dir: str | Path | None = None,
    chat_template_from: str | Path | None = None,
    **overrides,
) -> dict[str, str]:
    """Template values for a torch-engine repository; paths are made absolute.

    apply_chat_template (the served default when a request does not say) is the one home of that rule, for
    `build` and `serve` alike: True (the default) means "when the tokenizer has a chat template", read from
    chat_template_from (default: the tokenizer folder; `build` names the tokenizer it has not moved into
    place yet); False never applies it.
    """
    values = {
        "target_dir": Path(target_dir).resolve(),
        "drafter_dir": Path(drafter_dir).resolve(),
        "tokenizer_dir": Path(tokenizer_dir or target_dir).resolve(),
        "engine_backend": "torch",
        "max_batch": 16,
        "max_seq_len": 2048,
        "dtype": "auto",
        "apply_chat_template": True,  # when the tokenizer has a chat template (below)
        "triton_max_batch_size": 64,
        "unary_instance_count": 2,
        "cpu_threads": 0,  # torch intra-op threads of the engine process; 0 = torch's default
        "draft_cutoff": 0.0,  # decoding/draft_length.py; 0 = verify every draft
        "draft_length": "block",  # block | confidence | cost: decoding/draft_length.py
        "proposer": DEFAULT_PROPOSER,  # where drafts come from: decoding/options.py EngineOptions.proposer
        "max_queue": DEFAULT_MAX_QUEUE,  # requests waiting for admission before new ones are refused (overloaded)
        "decoupled": True,  # false: a unary engine model, so the ensemble is unary (HTTP / ModelInfer)
    }
    unknown = set(overrides) - set(values)
    if unknown:
        raise DFlashError(
            f"unknown model repository value(s): {', '.join(sorted(unknown))}; " f"known: {', '.join(values)}"
        )
    values.update(overrides)
    mq = values["max_queue"]
    if isinstance(mq, bool) or not str(mq).strip().isdigit() or int(mq) < 1:
        raise DFlashError(f"max_queue={mq!r}: must be an integer >= 1 (requests waiting for admission)")
    if values["apply_chat_template"]:
        values["apply_chat_template"] = bool(read_chat_template(Path(chat_template_from or values["tokenizer_dir"])))
    return {k: _text(k, v) for k, v in values.items()}


def _text(key: str, value) -> str:
    if isinstance(value, bool):
        value = "true" if value else "false"
    s = str(value)
    if any(c in s for c in '"\\\n'):
        raise DFlashError(f"model repository value {key}={s!r}: must not contain quotes, backslashes or newlines")
    return s


def placeholders(template_dir: str | Path) -> dict[str, list[str]]:
    """Placeholder name -> template files (relative paths) that use it."""
    template_dir = Path(template_dir)
    found: dict[str, list[str]] = {}
    for f in sorted(template_dir.rglob("*")):
        if f.is_file() and f.suffix in TEMPLATE_SUFFIXES:
            for name in PLACEHOLDER.findall(f.read_text()):
                rel = str(f.relative_to(template_dir))
                if rel not in found.setdefault(name, []):
                    found[name].append(rel)
    return found


def fill_model_repo(template_dir: str | Path, out_dir: str | Path, values: dict) -> Path:
    """Copy template_dir to out_dir with every `${name}` in config files replaced by values[name]."""
    template_dir, out_dir = Path(template_dir), Path(out_dir).resolve()
    if not template_dir.is_dir():
        raise DFlashError(f"template folder {template_dir}: not found")
    used = placeholders(template_dir)
    missing = {k: v for k, v in used.items() if k not in values}
    if missing:
        detail = "; ".join(f"{k} (in {', '.join(files)})" for k, files in sorted(missing.items()))
        raise DFlashError(f"model repository template needs values for: {detail}")
    text = {k: _text(k, v) for k, v in values.items()}
    with atomic_dir(out_dir) as tmp:
        shutil.copytree(
            template_dir, tmp, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".gitkeep")
        )
        for f in tmp.rglob("*"):
            if f.is_file() and f.suffix in TEMPLATE_SUFFIXES:
                filled = PLACEHOLDER.sub(lambda m: text[m.group(1)], f.read_text())
                _check_pbtxt(f, filled)
                f.write_text(filled)
        for model in tmp.iterdir():  # Triton needs each model's version folder, even an empty one
            if (model / "config.pbtxt").is_file():
                (model / "1").mkdir(exist_ok=True)
    return out_dir


def _check_pbtxt(path: Path, text: str) -> None:
    """Parse a filled config.pbtxt with Triton's ModelConfig schema when tritonclient is installed."""
    try:
        # deferred: optional dependency (protobuf comes with tritonclient, the `serve` extra)
        from google.protobuf import text_format
        from tritonclient.grpc import model_config_pb2
    except ImportError:
        return
    try:
        text_format.Parse(text, model_config_pb2.ModelConfig())
    except text_format.ParseError as e:
        raise DFlashError(f"{path.parent.name}/{path.name}: invalid model config after filling: {e}") from None


# ---- reading a filled repository (the OpenAI API's view of it) --------------------------------
FRONT_DOORS = ("dflash_bls", "dflash_unary")  # the streaming one, else the unary one of a decoupled: false build


@dataclass(frozen=True)
class RepoInfo:
    """What the API needs from a filled model repository (serving/repo.py placeholders)."""

    tokenizer_dir: Path
    target_dir: Path
    max_seq_len: int
    front_door: str = "dflash_bls"  # dflash_unary in a `decoupled: false` build (no streaming front door)

    @classmethod
    def read(cls, model_repo: str | Path) -> RepoInfo:
        repo = Path(model_repo)
        door = next((m for m in FRONT_DOORS if (repo / m / "config.pbtxt").is_file()), FRONT_DOORS[0])
        bls, engine = _parameters(repo / door / "config.pbtxt"), _parameters(repo / "dflash" / "config.pbtxt")
        try:
            max_seq_len = int(engine.get("max_seq_len", "2048"))
            return cls(Path(bls["tokenizer_dir"]), Path(engine["target_dir"]), max_seq_len, door)
        except (KeyError, ValueError) as e:
            raise DFlashError(f"{repo}: model repository lacks or garbles parameter {e} (refill it)") from None

    @property
    def streams(self) -> bool:
        """Whether the front door streams (decoupled); the unary one answers a streamed request in one chunk."""
        return self.front_door == "dflash_bls"


def default_model_name(model_repo: Path, target_dir: Path) -> str:
    """The model id /v1/models reports when --served-model-name is not given: the `target` of the
    `dflash-trt build` whose model_repo this is (its build.json, one folder up: a registry name, or a
    folder's name), else the served target folder's name (a build's is just `engine/target`)."""
    try:
        target = json.loads((Path(model_repo).parent / "build.json").read_text())["config"]["target"]
    except (OSError, ValueError, KeyError, TypeError):
        return target_dir.name
    return Path(str(target)).name if str(target).strip() else target_dir.name


def _parameters(config: Path) -> dict[str, str]:
    # deferred: protobuf comes with tritonclient (the `serve` extra)
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    if not config.is_file():
        raise DFlashError(f"{config}: not found; --model-repo must be a repository filled by `dflash-trt build`")
    cfg = text_format.Parse(config.read_text(), model_config_pb2.ModelConfig())
    return {k: v.string_value for k, v in cfg.parameters.items()}


def override_parameter(model_repo: str | Path, out_dir: str | Path, key: str, value: str) -> Path:
    """A view of a filled repository with one engine parameter changed for this run (`serve --proposer`):
    the same build, the repository itself never written. out_dir gets a link to every model folder, except
    the models whose config.pbtxt sets `key`: a folder of links to their files with that line rewritten."""
    model_repo, out_dir = Path(model_repo).resolve(), Path(out_dir)
    pattern = re.compile(
        r'(parameters\s*\{\s*key:\s*"' + re.escape(key) + r'"\s*value:\s*\{\s*string_value:\s*")[^"]*"'
    )
    value = _text(key, value)
    found = []
    out_dir.mkdir(parents=True, exist_ok=True)
    for model in sorted(model_repo.iterdir()):
        cfg = model / "config.pbtxt"
        text = cfg.read_text() if cfg.is_file() else ""
        if not pattern.search(text):
            (out_dir / model.name).symlink_to(model)
            continue
        found.append(model.name)
        (out_dir / model.name).mkdir()
        for f in model.iterdir():
            if f.name != "config.pbtxt":
                (out_dir / model.name / f.name).symlink_to(f)
        (out_dir / model.name / "config.pbtxt").write_text(pattern.sub(lambda m: m.group(1) + value + '"', text))
    if not found:
        raise DFlashError(
            f"{model_repo}: no model sets the {key!r} parameter (not a dflash-trt torch-engine repository?); "
            f"rebuild it with {key} in build.yaml instead"
        )
    return out_dir
