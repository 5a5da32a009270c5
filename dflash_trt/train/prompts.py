"""Prompt sources for training data and evaluation: built-in offline sets and user files.

Boundary: names in, lists of prompt strings out; nothing here runs a model.
Built-in offline sources (on every machine): `stdlib` — docstrings of the Python standard
library turned into code-writing prompts (four phrasings); `stdlib-code` — only "complete this
function" prompts (signature plus full docstring, as a user pastes a stub), the shape of code
completion requests and of HumanEval, so the drafter sees answers that echo and finish a stub.
Held out on purpose: HumanEval and the WritingBench prompts used by `dflash-trt bench` never come
from these sources (HELD_OUT: eval only).
"""

from __future__ import annotations

import importlib
import inspect
import json
import random
import re
from pathlib import Path

from dflash_trt.bench.datasets import load_dataset
from dflash_trt.errors import DFlashError

STDLIB_MODULES = (
    "string",
    "textwrap",
    "json",
    "itertools",
    "functools",
    "collections",
    "heapq",
    "bisect",
    "statistics",
    "fractions",
    "random",
    "re",
    "datetime",
    "calendar",
    "shutil",
    "os.path",
    "pathlib",
    "csv",
    "base64",
    "difflib",
    "fnmatch",
    "glob",
    "html",
    "ipaddress",
    "operator",
    "copy",
    "math",
    "zipfile",
    "tarfile",
    "gzip",
    "hashlib",
    "uuid",
    "urllib.parse",
    "email.utils",
    "configparser",
    "argparse",
    "logging",
    "inspect",
    "ast",
    "tokenize",
    "dataclasses",
    "enum",
    "typing",
    "queue",
    "threading",
    "subprocess",
    "tempfile",
    "locale",
    "gettext",
    "pprint",
)

# a second, wider set (prompts appended after the first set's, so older data folders stay aligned);
# modules missing from this Python are skipped
MORE_STDLIB_MODULES = (
    "io",
    "struct",
    "decimal",
    "numbers",
    "cmath",
    "codecs",
    "unicodedata",
    "secrets",
    "hmac",
    "binascii",
    "zlib",
    "bz2",
    "lzma",
    "shlex",
    "sched",
    "contextlib",
    "abc",
    "weakref",
    "types",
    "graphlib",
    "reprlib",
    "keyword",
    "linecache",
    "traceback",
    "warnings",
    "timeit",
    "doctest",
    "unittest",
    "sqlite3",
    "xml.etree.ElementTree",
    "xml.dom.minidom",
    "html.parser",
    "http.client",
    "http.cookies",
    "http.server",
    "urllib.request",
    "email.message",
    "email.header",
    "mimetypes",
    "wave",
    "colorsys",
    "plistlib",
    "netrc",
    "filecmp",
    "stat",
    "selectors",
    "socket",
    "asyncio",
    "concurrent.futures",
    "multiprocessing.pool",
    "platform",
    "sysconfig",
    "importlib.metadata",
    "pkgutil",
    "zipimport",
    "compileall",
    "dis",
    "pickle",
    "shelve",
    "dbm",
    "array",
    "getopt",
    "optparse",
    "cmd",
    "code",
    "quopri",
    "smtplib",
    "imaplib",
    "ftplib",
    "poplib",
    "xmlrpc.client",
    "json.decoder",
    "tomllib",
    "zoneinfo",
    "wsgiref.util",
    "wsgiref.headers",
    "urllib.robotparser",
    "posixpath",
    "fileinput",
    "pydoc",
    "runpy",
    "symtable",
    "tabnanny",
    "token",
    "pyclbr",
    "py_compile",
    "modulefinder",
    "trace",
    "tracemalloc",
    "atexit",
    "signal",
    "errno",
    "copyreg",
)

HELD_OUT = ("humaneval", "writingbench")  # benchmark sets: never training data (see generate_data)


def _first_paragraph(obj) -> str | None:
    doc = inspect.getdoc(obj)
    if not doc or len(doc) < 40:
        return None
    return doc.strip().split("\n\n")[0].replace("\n", " ")


def stdlib_prompts(limit: int | None = None) -> list[str]:
    """Code prompts built from standard-library docstrings, in a fixed order that only ever grows at
    the end (so resumed data folders stay aligned with their shards): for STDLIB_MODULES, module-level
    functions and classes, then public methods of those classes, then a second phrasing of the
    functions, then "complete this stub" prompts (signature + docstring, the shape of code-completion
    requests); then the same four families for MORE_STDLIB_MODULES, interleaved so that any --limit
    past the first block takes all four shapes from every module."""
    out = [p for family in _families(STDLIB_MODULES) for p in family]
    more = _families(tuple(m for m in MORE_STDLIB_MODULES if m not in STDLIB_MODULES))
    for i in range(max(map(len, more))):
        out += [family[i] for family in more if i < len(family)]
    return out[:limit] if limit else out


def _public_members(modules: tuple[str, ...]):
    """(name, function or class, [(method name, method)]) for the public functions and classes of each
    importable module, sorted by name; the methods are a class's own public functions, listed only
    for classes defined in that module's package (not re-exported ones)."""
    for name in modules:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        for fname, fn in sorted(vars(mod).items()):
            if fname.startswith("_") or not (inspect.isfunction(fn) or inspect.isclass(fn)):
                continue
            own = inspect.isclass(fn) and getattr(fn, "__module__", "").split(".")[0] == name.split(".")[0]
            methods = (
                [(m, f) for m, f in sorted(vars(fn).items()) if not m.startswith("_") and inspect.isfunction(f)]
                if own
                else []
            )
            yield fname, fn, methods


def _families(modules: tuple[str, ...]) -> list[list[str]]:
    items: list[tuple[str, str, str]] = []  # (kind, qualified name, first docstring paragraph)
    methods: list[tuple[str, str, str]] = []
    stubs: list[str] = []  # "def name(signature):" + docstring, for functions then methods
    method_stubs: list[str] = []
    for fname, fn, own_methods in _public_members(modules):
        first = _first_paragraph(fn)
        if first is None:
            continue
        items.append(("class" if inspect.isclass(fn) else "function", fname, first))
        if inspect.isfunction(fn):
            stubs += _stub(fname, fn, first)
        for mname, m in own_methods:
            mdoc = _first_paragraph(m)
            if mdoc:
                methods.append(("method", f"{fname}.{mname}", mdoc))
                method_stubs += _stub(mname, m, mdoc, owner=fname)
    return [
        [
            f"Write a Python {kind} `{qn}` that does the following: {first}\nExplain briefly, then give the code."
            for kind, qn, first in items
        ],
        [
            f"Write the Python method `{qn}` that does the following: {first}\nGive the code with a short docstring."
            for _, qn, first in methods
        ],
        [
            f"Implement `{qn}` in Python from scratch, with type hints and a docstring: {first}"
            for kind, qn, first in items
            if kind == "function"
        ],
        [
            f"Finish this Python code; answer with the complete code in a single code block.\n\n```python\n{stub}```"
            for stub in stubs + method_stubs
        ],
    ]


def _stub(name: str, fn, doc: str | None, owner: str | None = None) -> list[str]:
    """`def name(signature):` plus its docstring (a class line above methods); [] without a signature
    or docstring."""
    if not doc:
        return []
    try:
        sig = _readable_defaults(str(inspect.signature(fn)))
    except (TypeError, ValueError):
        return []
    body = f'def {name}{sig}:\n    """{doc}"""\n'
    if owner:
        body = f"class {owner}:\n" + "".join(f"    {line}\n" if line else "\n" for line in body.splitlines())
    return [body]


_REPRS = (
    (re.compile(r"<(?:function|built-in function|built-in method) ([\w.]+)(?: [^<>]*)?>"), r"\1"),
    (re.compile(r"<class '(?:[\w]+\.)*(\w+)'>"), r"\1"),
    (re.compile(r"<function \S+ at 0x[0-9a-f]+>"), "..."),
)  # lambdas, locals


def _readable_defaults(sig: str) -> str:
    """Default values whose repr is `<... at 0x...>` become their name (or `...`): the stub stays valid
    Python and the prompt text does not change from one process to the next."""
    for pattern, repl in _REPRS:
        sig = pattern.sub(repl, sig)
    return re.sub(r"<[^<>]*>", "...", sig)


CODE_INSTRUCTIONS = (
    "Finish this Python code; answer with the complete code in a single code block.",
    "Complete the Python function below and reply with the whole function in a code block.",
    "Implement the body of this function. Show the full function.",
    "Write the implementation for the following stub.",
)


def stdlib_code_prompts(limit: int | None = None) -> list[str]:
    """'Complete this function' prompts: `def name(signature):` plus the docstring (up to 16 lines,
    examples included) of every documented standard-library function and method of STDLIB_MODULES
    then MORE_STDLIB_MODULES, each set in a fixed seeded shuffle (so any --limit mixes modules, and
    the list only ever grows at the end), under one of CODE_INSTRUCTIONS in rotation."""
    stubs: list[str] = []
    seen: set[str] = set()
    for modules in (STDLIB_MODULES, tuple(m for m in MORE_STDLIB_MODULES if m not in STDLIB_MODULES)):
        block: list[str] = []
        for fname, fn, own_methods in _public_members(modules):
            if inspect.isfunction(fn):
                block += _stub(fname, fn, _doc_lines(fn))
            for mname, m in own_methods:
                block += _stub(mname, m, _doc_lines(m), owner=fname)
        block = [b for b in block if b not in seen and not seen.add(b)]
        random.Random(0).shuffle(block)
        stubs += block
    out = [f"{CODE_INSTRUCTIONS[i % len(CODE_INSTRUCTIONS)]}\n\n```python\n{stub}```" for i, stub in enumerate(stubs)]
    return out[:limit] if limit else out


def _doc_lines(fn, max_lines: int = 16) -> str | None:
    doc = inspect.getdoc(fn)
    if not doc or len(doc) < 40:
        return None
    lines = [line.rstrip() for line in doc.strip().replace('"""', "'''").splitlines()]
    if len(lines) > max_lines:  # cut at a paragraph break, never inside an example
        breaks = [i for i in range(1, max_lines) if not lines[i]]
        lines = lines[: breaks[-1] if breaks else max_lines]
    text = "\n".join(("    " + line) if line else "" for line in lines).lstrip()
    return text + "\n    " if len(lines) > 1 else text  # closing quotes on their own line (PEP 257)


def load_prompts(source: str, limit: int | None = None) -> list[str]:
    """`stdlib` / `stdlib-code` (training), `humaneval` / `writingbench` (held-out benchmark sets, for
    eval only), or a .txt file (one prompt per line) or .jsonl file ({"prompt": ...} per line)."""
    if source == "stdlib":
        return stdlib_prompts(limit)
    if source == "stdlib-code":
        return stdlib_code_prompts(limit)
    if source in HELD_OUT:
        return [p.text for p in load_dataset(source, limit)]
    p = Path(source)
    if not p.is_file():
        raise DFlashError(
            f"prompt source {source!r}: not a file and not a built-in source "
            f"(built-in: stdlib, stdlib-code; held-out for eval: {', '.join(HELD_OUT)})"
        )
    prompts = []
    for i, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        if p.suffix == ".jsonl":
            try:
                obj = json.loads(line)
                prompts.append(obj["prompt"] if isinstance(obj, dict) else str(obj))
            except (json.JSONDecodeError, KeyError):
                raise DFlashError(f'{p}:{i}: expected a JSON object with a "prompt" field') from None
        else:
            prompts.append(line)
    if not prompts:
        raise DFlashError(f"prompt source {p}: no prompts in it")
    return prompts[:limit] if limit else prompts
