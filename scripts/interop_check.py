"""Interop check: do the folders `dflash-trt build` emits for vLLM 0.33 / SGLang 0.5.23 load correctly there?

For every drafter family (dflash, dflash2, dspark, domino) x quant (bf16, fp8, nvfp4: target_quant =
drafter_quant = quant, fp8 KV cache when quantized) this builds a tiny random pair the way
tests/test_deploy_emit.py does, runs `dflash-trt build emit --emit vllm sglang`, and hands each
serve/<engine>.sh to scripts/interop_engines.py, which runs in a separate venv with the engines' own
code (CLI parser, config, model loader) on CPU. A row is
  ok                    every target and drafter tensor lands with a finite scale, dequantizes to our
                        dequantized weight, and the engine derives our method / draft count / layer ids;
  wrong (what)          the first problems found;
  refused-by-our-build  `dflash-trt build` refused the pair with one line (quoted).

Setup (opt-in; ~2.3 GB, see docs/deploy.md "Interop check"):
  python3 -m venv .interop-venv
  .interop-venv/bin/pip install torch==2.13.0 transformers==5.19.0
  .interop-venv/bin/pip install --no-deps vllm==0.33.0 sglang==0.5.23
  .interop-venv/bin/pip install $(python scripts/interop_check.py --print-deps)
Run (from the project venv): .venv/bin/python scripts/interop_check.py [--markdown] [--json FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INTEROP_PYTHON = Path(os.environ.get("DFLASH_INTEROP_PYTHON", ROOT / ".interop-venv" / "bin" / "python"))
FAMILIES = ("dflash", "dflash2", "dspark", "domino")
QUANTS = ("bf16", "fp8", "nvfp4")
ENGINES = ("vllm", "sglang")
# what the two engines' config / loader paths import, beyond torch + transformers (found by running them)
DEPS = (
    "psutil cbor2 pyzmq aiohttp requests openai-harmony openai msgspec cloudpickle pillow pybase64 cachetools "
    "uvloop py-cpuinfo prometheus_client xgrammar fastapi partial_json_parser llguidance einops "
    "compressed-tensors orjson IPython dill sentencepiece gguf"
).split()
SCALES = ("weight_scale", "weight_scale_2", "input_scale", "k_scale", "v_scale")


def engines_available(python: Path = INTEROP_PYTHON) -> str | None:
    """None when `python` imports vllm and sglang; else why not (the test's skip reason)."""
    if not python.is_file():
        return f"no interop venv at {python} (set DFLASH_INTEROP_PYTHON; setup: scripts/interop_check.py)"
    probe = "import importlib.util as u, sys; sys.exit(0 if u.find_spec('vllm') and u.find_spec('sglang') else 1)"
    if subprocess.run([str(python), "-c", probe], capture_output=True).returncode:
        return f"{python} lacks vllm / sglang (setup: scripts/interop_check.py)"
    return None


def reference(folder: Path, dst: Path) -> None:
    """Our view of a checkpoint folder: weights dequantized by dflash-trt's own code (float32) plus the
    scale tensors as written, saved to dst for the worker to compare against."""
    import torch
    from safetensors.torch import load_file, save_file

    from dflash_trt.deploy.quantize import dequantize_state_dict

    state = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(f)))
    qfile = folder / "hf_quant_config.json"
    qc = json.loads(qfile.read_text()) if qfile.is_file() else {"quantization": {}}
    out = dequantize_state_dict(state, qc)
    out.update({k: v.float() for k, v in state.items() if k.rpartition(".")[2] in SCALES and v.dtype != torch.uint8})
    out = {k: v.float().contiguous() if v.is_floating_point() else v.contiguous() for k, v in out.items()}
    save_file({k: v for k, v in out.items() if v.is_floating_point()}, str(dst))


def build_cases(root: Path, families=FAMILIES, quants=QUANTS, kv_cache: str = "fp8") -> list[dict]:
    """Emit every family x quant pair under root; returns one case per (family, quant)."""
    import torch
    import yaml
    from click.testing import CliRunner

    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import tiny_model_dir
    from test_deploy_emit import DRAFTERS, save_drafter

    from dflash_trt.cli import main
    from dflash_trt.config import DrafterConfig
    from dflash_trt.deploy.emit import num_drafts
    from dflash_trt.modeling.target import TargetModel

    tiny_model_dir(root / "target")
    target = TargetModel.from_pretrained(root / "target", dtype=torch.float32)
    cases = []
    for fam in families:
        arch, fields, vocab = DRAFTERS[fam]
        save_drafter(target, root / fam, arch, fields, vocab)
        dc = DrafterConfig.load(root / fam)
        for q in quants:
            name = f"{fam}-{q}"
            case = {"family": fam, "quant": q, "engines": {}}
            for engine in ENGINES:  # one build per engine: a refusal for one must not hide the other
                out = root / f"out-{name}-{engine}"
                cfg = {
                    "target": str(root / "target"),
                    "drafter": str(root / fam),
                    "max_batch": 4,
                    "max_seq_len": 256,
                    "emit": [engine],
                    "eval_prompts": 0,
                    "calib_prompts": 2,
                    "target_quant": q,
                    "drafter_quant": q,
                    "kv_cache": "bf16" if q == "bf16" else kv_cache,
                    **({"sm": "sm_100"} if q == "nvfp4" else {}),
                }
                y = root / f"{name}-{engine}.yaml"
                y.write_text(yaml.safe_dump(cfg))
                r = CliRunner().invoke(main, ["build", "emit", "--config", str(y), "--out", str(out)])
                if r.exit_code:  # exit 2: refused with one line; anything else is our build failing
                    lines = [ln.strip() for ln in r.output.splitlines() if ln.strip()]
                    last = lines[-1] if lines else f"exit {r.exit_code}"
                    if r.exception is not None and not isinstance(r.exception, SystemExit):
                        last = f"{type(r.exception).__name__}: {r.exception}"
                    key = "refused" if r.exit_code == 2 else "failed"
                    case["engines"][engine] = {key: last}
                    continue
                tgt = out / "quantized" / "target" if q != "bf16" else root / "target"
                reference(tgt, root / f"ref-{name}-{engine}-target.safetensors")
                reference(out / "serve" / engine / "drafter", root / f"ref-{name}-{engine}.safetensors")
                case["engines"][engine] = {
                    "job": {
                        "name": f"{name}-{engine}",
                        "engine": engine,
                        "script": str(out / "serve" / f"{engine}.sh"),
                        "ref_target": str(root / f"ref-{name}-{engine}-target.safetensors"),
                        "ref_drafter": str(root / f"ref-{name}-{engine}.safetensors"),
                        "kv_scales": cfg["kv_cache"] != "bf16",
                    },
                    "expect": {
                        "num_drafts": num_drafts(dc),
                        "block_size": dc.block_size,
                        "target_layer_ids": list(dc.target_layer_ids),
                        "method": "dspark" if fam == "dspark" else "dflash",
                    },
                }
            cases.append(case)
    return cases


def run_engine(engine: str, jobs: list[dict], work: Path, python: Path = INTEROP_PYTHON) -> dict[str, dict]:
    """Run the worker for one engine (its own process: vLLM and SGLang each patch global state)."""
    (work / f"jobs-{engine}.json").write_text(json.dumps(jobs))
    res = work / f"results-{engine}.json"
    proc = subprocess.run(
        [str(python), str(ROOT / "scripts" / "interop_engines.py"), str(work / f"jobs-{engine}.json"), str(res)],
        cwd=ROOT / "scripts",
        capture_output=True,
        text=True,
        timeout=3000,
    )
    (work / f"log-{engine}.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode or not res.is_file():
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        return {j["name"]: {"error": f"worker exit {proc.returncode}: {' | '.join(tail)}"} for j in jobs}
    return {r["name"]: r for r in json.loads(res.read_text())}


def verdict(entry: dict, result: dict | None) -> str:
    """One table cell: ok / wrong (what) / refused-by-our-build (why)."""
    if "refused" in entry:
        return f"refused-by-our-build ({entry['refused'].removeprefix('error: ')})"
    if "failed" in entry:
        return f"wrong (our build failed: {entry['failed'][:200]})"
    if result is None or "error" in result:
        return f"wrong (the engine raised: {(result or {}).get('error', 'no result')})"
    problems, d, e = list(result["problems"]), result["derived"], entry["expect"]
    if "num_drafts" in d:  # vLLM
        if (d["method"], d["num_drafts"]) != (e["method"], e["num_drafts"]):
            problems.append(f"derived method/num_speculative_tokens {d['method']}/{d['num_drafts']}")
    else:  # SGLang: DFLASH's block size is B, DSPARK's is the draft count
        want = e["num_drafts"] if e["method"] == "dspark" else e["block_size"]
        if d["block_size"] != want or e["method"].upper() not in d["method"].upper():
            problems.append(f"derived algorithm/block size {d['method']}/{d['block_size']}")
    if "target_layer_ids" in d and d["target_layer_ids"] != e["target_layer_ids"]:
        problems.append(f"target layer ids {d['target_layer_ids']} (ours {e['target_layer_ids']})")
    if not problems:
        return "ok"
    more = f"; +{len(problems) - 3} more" if len(problems) > 3 else ""
    return "wrong (" + "; ".join(problems[:3]) + more + ")"


@dataclasses.dataclass
class Row:
    family: str
    quant: str
    engine: str
    cell: str
    derived: dict


def check(
    work: Path, families=FAMILIES, quants=QUANTS, python: Path = INTEROP_PYTHON, kv_cache: str = "fp8"
) -> list[Row]:
    """kv_cache: the KV cache of the quantized rows (bf16 rows keep a bf16 one)."""
    cases = build_cases(work, families, quants, kv_cache)
    results = {}
    for engine in ENGINES:
        jobs = [c["engines"][engine]["job"] for c in cases if "job" in c["engines"][engine]]
        if jobs:
            results.update(run_engine(engine, jobs, work, python))
    rows = []
    for c in cases:
        for engine in ENGINES:
            entry = c["engines"][engine]
            res = results.get(entry["job"]["name"]) if "job" in entry else None
            rows.append(Row(c["family"], c["quant"], engine, verdict(entry, res), (res or {}).get("derived", {})))
    return rows


def markdown(rows: list[Row]) -> str:
    lines = ["| family | quant | vLLM 0.33 | SGLang 0.5.23 |", "| --- | --- | --- | --- |"]
    by = {(r.family, r.quant, r.engine): r.cell for r in rows}
    for fam in dict.fromkeys(r.family for r in rows):
        for q in dict.fromkeys(r.quant for r in rows):
            lines.append(f"| {fam} | {q} | {by[(fam, q, 'vllm')]} | {by[(fam, q, 'sglang')]} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--quants", nargs="+", default=list(QUANTS), choices=QUANTS)
    ap.add_argument(
        "--kv-cache", default="fp8", choices=("fp8", "bf16"), help="KV cache of the quantized rows (default fp8)"
    )
    ap.add_argument("--work", type=Path, help="keep the emitted folders and logs here (default: a temp dir)")
    ap.add_argument("--json", type=Path, help="also write the rows (with what each engine derived) here")
    ap.add_argument("--print-deps", action="store_true", help="print the interop venv's extra packages")
    a = ap.parse_args(argv)
    if a.print_deps:
        print(" ".join(DEPS))
        return 0
    why = engines_available()
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        work = a.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        rows = check(work, a.families, a.quants, kv_cache=a.kv_cache)
    if a.json:
        a.json.write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1))
    print(markdown(rows))
    return 0 if all(r.cell == "ok" or r.cell.startswith("refused") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
