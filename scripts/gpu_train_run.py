r"""Time-boxed GPU run of the drafter recipe (issue #3) on a lent GPU machine that cannot download models.

    python scripts/gpu_train_run.py pack --model DIR --out .gpu --bits 6      # here: the target in parts
    python scripts/gpu_train_run.py run --parts .gpu --budget 500             # there: data, train, eval

Why it exists: the lent GPU machine has PyTorch but no network, and a call carries at most
64 MiB, so the 1.2 GB bf16 target travels in parts over several calls, quantized per group of 64
weights to `bits` bits with an fp16 scale (6 bits: 0.5 GB, relative weight error about 1%; the
dequantized copy is the target there). `run` then does what scripts/recipe_qwen_coder.sh does, with
GPU-sized numbers and a wall-clock budget per stage: the target regenerates answers to the
standard-library code stubs, scores standard-library source (teacher-forced), answers the
validation prompts; a drafter trains online (target forward inside the step); the drafter is
evaluated on held-out HumanEval prompts; the drafter (bf16), the regenerated answers and the
logs come back in $OUT. The drafter is then evaluated here against the real bf16 target.
The weight transport (k-bit groups, parts; `pack` and `unpack`): scripts/gpu_train_transport.py.

The device calls (the `device` tool of this workplace; 15 min of device time in all, so plan the
whole sequence before the first call, and issue the calls back to back: a machine idle for 30 s
is given back with every part on it):
    echo /.gpu/ >> .git/info/exclude
    .venv/bin/python scripts/gpu_train_run.py pack --model ~/.cache/dflash-trt/models/qwen2.5-coder-0.5b-instruct
    .venv/bin/python scripts/heldout_split.py --dataset humaneval --eval-limit 8 --num 32 \
        --out .gpu/side/val_prompts.jsonl
    (the 8 eval prompts: {"prompt": p} lines of load_prompts("humaneval", 8) -> .gpu/side/eval_prompts.jsonl)
    mv dflash_trt/assets/drafters /tmp/   # 10 MB that would not fit beside a 60 MiB part; move back after
    run carry=[.gpu/p00] ... carry=[.gpu/p06]: `du -sh .gpu/*` (each call adds one part; warm machines keep them)
    run carry=[.gpu/p07, .gpu/side]: PYTHONUNBUFFERED=1 PYTHONPATH=. python3 scripts/gpu_train_run.py run --budget B
    (B = the call's timeout minus about 40 s; the drafter is shipped before the eval, so a kill during
    the eval loses only the eval), then give_back, then
    cat drafter.tar.* > d.tar && tar xf d.tar && \
        dflash-trt eval --target T --drafter drafter --prompts humaneval --limit 8
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo, also when not pip-installed
if str(Path(__file__).resolve().parent) not in sys.path:  # scripts/ (the sibling), when loaded by path (tests)
    sys.path.append(str(Path(__file__).resolve().parent))

import torch  # noqa: E402

# the weight transport; GROUP, quantize and dequantize are re-exported for tests/test_gpu_train_run.py
from gpu_train_transport import GROUP, dequantize, pack, quantize, unpack  # noqa: E402, F401


# ---- the time-boxed run ---------------------------------------------------------------------------
class Log:
    def __init__(self, path: Path):
        self.t0, self.f = time.time(), open(path, "a", buffering=1)

    def __call__(self, msg: str) -> None:
        line = f"[{time.time() - self.t0:6.1f}s] {msg}"
        print(line, flush=True)
        self.f.write(line + "\n")


def _answers(
    target, tok, prompts, out: Path, cap_s: float, log, batch: int, new_tokens: int, temperature: float, seed: int
) -> int:
    """Regenerate answers chunk by chunk (generate_data resumes) until the prompts or cap_s run out."""
    from dflash_trt.train.data import generate_data

    t, done = time.time(), 0
    while done < len(prompts):
        t1 = time.time()
        nxt = min(len(prompts), done + batch)
        generate_data(
            target,
            tok,
            prompts[:nxt],
            out,
            new_tokens,
            batch,
            shard_size=batch,
            temperature=temperature,
            seed=seed,
            progress=False,
        )
        took = time.time() - t1
        done = nxt
        log(f"  answers {out.name}: {done}/{len(prompts)} ({took:.1f}s for {batch})")
        if time.time() - t + took > cap_s:
            break
    return done


def run(a) -> None:
    out = Path(a.out or os.environ.get("OUT", "/tmp/gpu_out"))
    out.mkdir(parents=True, exist_ok=True)
    log = Log(out / "run.log")
    deadline = log.t0 + a.budget
    dev = torch.device(a.device)
    import transformers

    from dflash_trt.api import load_target, load_tokenizer
    from dflash_trt.train.corpus import load_texts, score_corpus
    from dflash_trt.train.data import generate_data, mark_validation, read_sequences
    from dflash_trt.train.prompts import load_prompts
    from dflash_trt.train.trainer import TrainConfig, train

    log(
        f"torch {torch.__version__}, transformers {transformers.__version__}, python {sys.version.split()[0]}, "
        f"device {torch.cuda.get_device_name(0) if dev.type == 'cuda' else 'cpu'}"
    )
    work = Path(a.work)
    shutil.rmtree(work, ignore_errors=True)
    tdir = unpack(Path(a.parts), work / "target", dev)
    target, _ = load_target(str(tdir), "bfloat16", progress=False, device=dev)
    tok = load_tokenizer(tdir)
    log(f"target unpacked and loaded: {tdir}")

    data_dirs = []
    try:  # 1. regenerated answers to the standard-library code stubs (greedy), then sampled ones
        prompts = load_prompts(a.prompts)
        end = time.time() + a.answers_s
        n = _answers(target, tok, prompts, work / "answers", a.answers_s, log, a.gen_batch, a.new_tokens, 0.0, 0)
        data_dirs.append(work / "answers")
        if n == len(prompts) and a.sampled and time.time() < end:
            data_dirs.append(work / "answers_t07")
            _answers(
                target, tok, prompts, work / "answers_t07", end - time.time(), log, a.gen_batch, a.new_tokens, 0.7, 1
            )
    except Exception:
        log("answers FAILED:\n" + traceback.format_exc())
    try:  # 2. validation answers (held-out HumanEval prompts, disjoint from the eval's)
        val = work / "val"
        val.mkdir(parents=True)
        mark_validation(val, "humaneval-heldout")
        generate_data(target, tok, load_prompts(a.val_prompts), val, 128, 64, progress=False)
        log(f"validation answers: {len(read_sequences(val))}")
    except Exception:
        val = None
        log("validation FAILED:\n" + traceback.format_exc())
    try:  # 3. teacher-forced windows of standard-library source
        t = time.time()
        texts = load_texts(a.text)
        lim = 0
        while time.time() - t < a.score_s:
            lim += a.score_chunk
            score_corpus(
                target, tok, texts, work / "scored", 512, lim, a.score_batch, shard_size=a.score_chunk, progress=False
            )
            got = len(read_sequences(work / "scored"))
            log(f"  scored windows: {got}")
            if got < lim:
                break
    except Exception:
        log("scoring FAILED:\n" + traceback.format_exc())
    data_dirs = [d for d in data_dirs + [work / "scored"] if list(d.glob("data-*.jsonl"))]  # written shards only
    sizes = {d.name: read_sequences(d) for d in data_dirs}
    log(
        "data: "
        + ", ".join(
            f"{name} {len(seqs)} seqs {sum(len(q['input_ids']) for q in seqs)} tok" for name, seqs in sizes.items()
        )
    )

    base = dict(
        target=str(tdir),
        data=",".join(map(str, data_dirs)),
        num_layers=a.layers,
        block_size=16,
        anchors_per_seq=16,
        batch_size=a.train_batch,
        lr=6e-4,
        gamma=a.gamma,
        # a family's heads train on the full vocabulary; a warm start keeps its backbone's
        draft_vocab=16384 if a.family == "dflash" and not a.init_from else 0,
        family=a.family,
        family_fields=json.loads(a.family_fields),
        init_from=a.init_from,
        freeze_backbone=a.freeze_backbone,
        features="online",
        max_seq_len=512,
        val_data=str(val) if val else None,
        log_every=20,
    )
    drafter_dir = None
    try:  # 4. train: calibrate the step time, then fit whole epochs into what is left before the eval
        t = time.time()
        spans = []
        for steps in (3, 11):  # the difference of two short runs: the step time without the setup
            t1 = time.time()
            train(
                TrainConfig(
                    **{**base, "val_data": None},
                    out=str(work / f"cal{steps}"),
                    epochs=1,
                    max_steps=steps,
                    save_every=10**6,
                ),
                target,
                progress=False,
            )
            spans.append(time.time() - t1)
        per_step = max(1e-3, (spans[1] - spans[0]) / 8) * 1.1  # 10% for the held-out checks and saves
        seqs = sum(map(len, sizes.values()))
        per_epoch = math.ceil(seqs / a.train_batch)
        budget = deadline - time.time() - a.reserve_s
        fit = int(budget / per_step)
        epochs = max(1, min(a.max_epochs, fit // per_epoch))
        max_steps = None if fit >= per_epoch else max(1, fit)
        save_every = max(50, (epochs * per_epoch if max_steps is None else max_steps) // 4)
        log(
            f"train ({a.family}): {seqs} seqs, {per_epoch} steps/epoch, {per_step:.3f} s/step (calibration, "
            f"setup {spans[0]:.1f}s), budget {budget:.0f}s -> epochs {epochs}, max_steps {max_steps}"
        )
        drafter_dir = train(
            TrainConfig(**base, out=str(work / "train"), epochs=epochs, max_steps=max_steps, save_every=save_every),
            target,
            progress=False,
        )
        log(f"trained in {time.time() - t:.0f}s -> {drafter_dir}")
        shutil.copy(work / "train" / "metrics.jsonl", out / "metrics.jsonl")
    except Exception:
        log("train FAILED:\n" + traceback.format_exc())
        if (work / "train" / "metrics.jsonl").is_file():
            shutil.copy(work / "train" / "metrics.jsonl", out / "metrics.jsonl")
    _ship(work, out, drafter_dir, data_dirs, log)
    if drafter_dir and time.time() < deadline - 10:
        try:  # 5. real DFlash generation on held-out HumanEval prompts (fp32 target: exact greedy equality)
            from dflash_trt.train.evaluate import evaluate

            target.float()
            res = evaluate(
                str(tdir), str(drafter_dir), a.eval_prompts, limit=8, max_new_tokens=128, target_model=(target, tdir)
            )
            (out / "eval_gpu.json").write_text(json.dumps(res, indent=1))
            log(
                f"GPU eval: tau {res['tau']:.2f}, speedup {res['speedup']:.2f}x, per-position "
                + " ".join(f"{p:.2f}" for p in res["per_position_acceptance"][:6])
            )
        except Exception:
            log("eval FAILED:\n" + traceback.format_exc())
    log("done")


def _ship(work: Path, out: Path, drafter_dir, data_dirs, log) -> None:
    """The drafter (bf16) as <= 15 MiB pieces, and the regenerated answers, into $OUT."""
    import tarfile

    from safetensors.torch import load_file, save_file

    try:
        if drafter_dir:
            d = Path(drafter_dir)
            st = load_file(str(d / "model.safetensors"))
            save_file(
                {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in st.items()},
                str(d / "model.safetensors"),
                metadata={"format": "pt"},
            )
            with tarfile.open(work / "drafter.tar", "w") as tf:
                tf.add(d, arcname="drafter")
            raw = (work / "drafter.tar").read_bytes()
            step = 15 * 2**20
            for i in range(math.ceil(len(raw) / step)):
                (out / f"drafter.tar.{i}").write_bytes(raw[i * step : (i + 1) * step])
            log(f"drafter: {len(raw) / 2**20:.1f} MiB in {math.ceil(len(raw) / step)} pieces")
        answers = [d for d in data_dirs if d.name.startswith("answers")]
        if answers:
            with tarfile.open(out / "answers.tar.xz", "w:xz") as tf:
                for d in answers:
                    tf.add(d, arcname=d.name)
            log(f"answers: {(out / 'answers.tar.xz').stat().st_size / 2**20:.1f} MiB")
    except Exception:
        log("ship FAILED:\n" + traceback.format_exc())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="the target's weights in transport parts (here)")
    p.add_argument("--model", required=True, help="HF folder of the target (dflash-trt models fetch ...)")
    p.add_argument("--out", default=".gpu")
    p.add_argument("--bits", type=int, default=6, choices=(4, 5, 6, 7, 8))
    p.add_argument(
        "--part-mb",
        type=float,
        default=60,
        help="60 MiB parts + the checkout (about 1.3 MiB without dflash_trt/assets/drafters, which the calls "
        "move aside) fit one call's 64 MiB",
    )
    r = sub.add_parser("run", help="data, training and eval on the GPU within --budget seconds (there)")
    r.add_argument("--parts", default=".gpu")
    r.add_argument("--out", default=None, help="default $OUT")
    r.add_argument("--work", default="/tmp/gpu_work")
    r.add_argument("--device", default="cuda")
    r.add_argument("--budget", type=float, default=500, help="seconds for everything")
    r.add_argument("--answers-s", type=float, default=150)
    r.add_argument("--score-s", type=float, default=45)
    r.add_argument("--reserve-s", type=float, default=60, help="kept for shipping and the eval after training")
    r.add_argument("--gen-batch", type=int, default=256)
    r.add_argument("--new-tokens", type=int, default=256)
    r.add_argument(
        "--sampled",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="after the greedy answers, sampled (T=0.7) ones while the answers budget lasts",
    )
    r.add_argument("--prompts", default="stdlib-code", help="training prompts (as `data generate --prompts`)")
    r.add_argument("--text", default="stdlib-src", help="text the target scores (as `data score --text`)")
    r.add_argument("--score-chunk", type=int, default=1024)
    r.add_argument("--score-batch", type=int, default=32)
    r.add_argument("--train-batch", type=int, default=32)
    r.add_argument("--layers", type=int, default=1)
    r.add_argument(
        "--family", default="dflash", help="drafter family (train --family): dflash | dflash2 | dspark | domino"
    )
    r.add_argument(
        "--family-fields", default="{}", help='its fields as JSON (train --family-fields), e.g. {"markov_rank": 64}'
    )
    r.add_argument("--init-from", default=None, help="warm start from this DFlash drafter folder (train --init-from)")
    r.add_argument(
        "--freeze-backbone",
        action="store_true",
        help="with --init-from: train only the family's heads (train --freeze-backbone)",
    )
    r.add_argument("--gamma", type=float, default=4)
    r.add_argument("--max-epochs", type=int, default=12)
    r.add_argument("--val-prompts", default=".gpu/side/val_prompts.jsonl")
    r.add_argument("--eval-prompts", default=".gpu/side/eval_prompts.jsonl")
    a = ap.parse_args()
    if a.cmd == "pack":
        pack(Path(a.model), Path(a.out), a.bits, a.part_mb)
    else:
        run(a)


if __name__ == "__main__":
    main()
