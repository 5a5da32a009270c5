"""`dflash-trt build` on tiny random models: the torch build served by a real tritonserver, config
errors, the stage cache, atomic out dirs, the TensorRT-LLM refusal, the llmapi / vLLM / SGLang files
and the quantized-vs-bf16 eval report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from conftest import tiny_hf, tiny_pair_dir

from dflash_trt.cli import main
from dflash_trt.config import DrafterConfig

BLOCK = 4


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("build")
    return root, tiny_pair_dir(root, block_size=BLOCK)


def write_yaml(path: Path, **fields) -> Path:
    path.write_text(yaml.safe_dump(fields))
    return path


def base_fields(root: Path, **over) -> dict:
    return {
        "target": str(root / "target"),
        "drafter": str(root / "drafter"),
        "dtype": "float32",
        "max_batch": 4,
        "max_seq_len": 256,
        "instance_count": 1,
        "cpu_threads": 1,
        **over,
    }


def cli(*args):
    return CliRunner().invoke(main, ["build", *map(str, args)], catch_exceptions=False)


def build(tmp_path, root, out_name="out", *extra, **fields):
    cfg = write_yaml(tmp_path / f"{out_name}.yaml", **base_fields(root, **fields))
    out = tmp_path / out_name
    r = cli("--config", cfg, "--out", out, *extra)
    assert r.exit_code == 0, r.output
    return out, json.loads((out / "build.json").read_text())


def statuses(manifest) -> dict[str, str]:
    return {k: v["status"] for k, v in manifest["stages"].items()}


def leftovers(parent: Path, name: str) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.")]


# ---- (a) torch build served by the real tritonserver -------------------------------------------
def test_torch_build_is_served_with_in_process_greedy_text(pair, tmp_path):
    pytest.importorskip("pytriton", reason="nvidia-pytriton not installed (pip install 'dflash-trt[serve]')")
    pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] not installed")
    from dflash_trt.api import load_drafter
    from dflash_trt.config import SamplingParams
    from dflash_trt.decoding.loop import generate
    from dflash_trt.serving.client import DFlashClient
    from dflash_trt.serving.server import TritonServer
    from dflash_trt.serving.text import TextCodec

    root, target = pair
    out, manifest = build(tmp_path, root)
    assert statuses(manifest) == {
        "check": "ran",
        "quantize": "not needed",
        "engine": "ran",
        "repo": "ran",
        "emit": "not needed",
        "eval": "not needed",
    }
    assert manifest["inputs"]["target"]["files"]["model.safetensors"]
    assert (
        manifest["versions"]["torch"] and manifest["versions"]["transformers"] and manifest["config"]["max_batch"] == 4
    )
    assert json.loads((out / "engine" / "manifest.json").read_text())["block_size"] == BLOCK
    codec = TextCodec.from_dir(out / "engine" / "tokenizer")
    drafter = load_drafter(target, str(out / "engine" / "drafter"))
    with TritonServer(out / "model_repo", startup_timeout=300) as srv, DFlashClient(srv.grpc_url) as client:
        for prompt, n in [("hello world", 20), ("héllo wörld ✓ 漢字", 12)]:
            toks = generate(target, drafter, [codec.encode(prompt, True)], SamplingParams(max_new_tokens=n)).tokens[
                0
            ]  # chat: true
            assert client.generate(prompt, max_tokens=n)["text"] == codec.decode(toks)
        # the `dflash-trt client` command prints the text (unary and streamed) and the statistics
        want = codec.decode(toks)
        for extra in ([], ["--stream"]):
            r = CliRunner().invoke(
                main, ["client", "--url", srv.grpc_url, "--prompt", prompt, "--max-tokens", str(n), *extra]
            )
            assert r.exit_code == 0, r.output
            assert r.stdout.startswith(want) and "acceptance length" in r.stderr
        r = CliRunner().invoke(
            main, ["client", "--url", srv.grpc_url, "--prompt", prompt, "--max-tokens", str(n), "--json"]
        )
        assert json.loads(r.stdout)["text"] == want
        sampled = [
            CliRunner().invoke(
                main,
                [
                    "client",
                    "--url",
                    srv.grpc_url,
                    "--prompt",
                    prompt,
                    "--max-tokens",
                    "8",
                    "--temperature",
                    "0.9",
                    "--top-k",
                    "20",
                    "--top-p",
                    "0.9",
                    "--seed",
                    "7",
                    "--json",
                ],
            )
            for _ in range(2)
        ]
        assert all(x.exit_code == 0 for x in sampled), sampled[0].output
        assert json.loads(sampled[0].stdout)["text"] == json.loads(sampled[1].stdout)["text"]  # seeded
        r = CliRunner().invoke(main, ["client", "--url", srv.grpc_url, "--prompt", prompt, "--top-p", "1.5"])
        assert r.exit_code == 2 and "top_p" in r.output  # the server's field-naming error, one line


# ---- (b) bad configs fail in check with one line naming the field ------------------------------
def _other_target_drafter(root: Path) -> Path:
    """A drafter made for a different (narrower) target: hidden_size 32 instead of 64."""
    folder = root / "other_drafter"
    if not folder.exists():
        cfg = DrafterConfig.for_target(tiny_hf(hidden_size=32).config, num_layers=1, block_size=BLOCK)
        from dflash_trt.modeling.drafter import DFlashDrafter

        DFlashDrafter(cfg).save_pretrained(folder)
    return folder


def _dflash2_drafter(root: Path) -> Path:
    """A DFlash 2 drafter for the pair's target (no per-draft probability: proposer=hybrid cannot weigh it)."""
    import dataclasses

    from transformers import AutoConfig

    from dflash_trt.modeling.drafter import DFlashDrafter

    folder = root / "dflash2_drafter"
    if not folder.exists():
        cfg = DrafterConfig.for_target(AutoConfig.from_pretrained(root / "target"), num_layers=1, block_size=BLOCK)
        cfg = dataclasses.replace(
            cfg,
            architectures=["DFlash2DraftModel"],
            family_fields={"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 4, "selector_top_k": 3},
        )
        DFlashDrafter(cfg).save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    "case, want",
    [
        ("unknown_field", "max_batchh"),
        ("wrong_type", "max_batch='lots': must be an integer"),
        ("incompatible_drafter", "hidden_size"),
        ("nvfp4_on_hopper", "target_quant=nvfp4"),
        ("missing_tokenizer", "tokenizer="),
        ("draft_cutoff", "draft_cutoff=1.0"),
        ("draft_length", "draft_length=confidence needs draft_cutoff > 0"),
        ("draft_length_name", "draft_length='sometimes': choose one of block, confidence"),
        ("no_confidence_head", "draft_length=confidence: this DFlash drafter has no confidence head"),
        ("proposer_name", "proposer='suffix': unknown; use one of dflash, ngram, hybrid"),
        ("ngram_with_cutoff", "proposer=ngram: draft_cutoff / draft_length=confidence act on"),
        ("hybrid_dflash2", "proposer=hybrid: DFlash 2 drafters give no per-draft probability"),
    ],
)
def test_bad_config_fails_check_with_one_line(pair, tmp_path, case, want):
    root, _ = pair
    fields = base_fields(root)
    if case == "unknown_field":
        fields["max_batchh"] = 3
    elif case == "wrong_type":
        fields["max_batch"] = "lots"
    elif case == "incompatible_drafter":
        fields["drafter"] = str(_other_target_drafter(root))
    elif case == "nvfp4_on_hopper":
        fields.update(target_quant="nvfp4", sm="sm_90")
    elif case == "draft_cutoff":
        fields["draft_cutoff"] = 1.0
    elif case == "draft_length":
        fields["draft_length"] = "confidence"
    elif case == "draft_length_name":
        fields["draft_length"] = "sometimes"
    elif case == "no_confidence_head":  # the plain DFlash drafter has none: refused in check, not at serve time
        fields.update(draft_length="confidence", draft_cutoff=0.3)
    elif case == "proposer_name":
        fields["proposer"] = "suffix"
    elif case == "ngram_with_cutoff":  # the drafter's cutoff has no drafter drafts to gate
        fields.update(proposer="ngram", draft_cutoff=0.3)
    elif case == "hybrid_dflash2":
        fields.update(proposer="hybrid", drafter=str(_dflash2_drafter(root)))
    else:
        fields["tokenizer"] = str(root / "drafter")  # a folder without tokenizer files
    r = cli("check", "--config", write_yaml(tmp_path / "b.yaml", **fields))
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert lines[0].startswith("error: ") and want in lines[0], lines[0]
    if case == "nvfp4_on_hopper":
        assert "sm=sm_90" in lines[0] and "Blackwell" in lines[0]


def test_cli_override_and_dry_check(pair, tmp_path):
    root, _ = pair
    cfg = write_yaml(tmp_path / "c.yaml", **base_fields(root))
    r = cli("check", "--config", cfg, "--max-batch", "oops")
    assert r.exit_code == 2 and "max_batch='oops'" in r.output
    r = cli("check", "--config", cfg)
    assert r.exit_code == 0 and "check: ok" in r.output and not (tmp_path / "out").exists()


def test_stage_subcommand_runs_that_stage_and_its_dependencies(pair, tmp_path):
    root, _ = pair
    cfg = write_yaml(tmp_path / "s.yaml", **base_fields(root))
    r = cli("engine", "--config", cfg, "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output
    m = json.loads((tmp_path / "out" / "build.json").read_text())
    assert statuses(m)["check"] == statuses(m)["engine"] == "ran" and statuses(m)["repo"] == "not run"
    assert not (tmp_path / "out" / "model_repo").exists()
    r = cli("--config", cfg, "--out", tmp_path / "out")  # the full build reuses what the stage built
    m = json.loads((tmp_path / "out" / "build.json").read_text())
    assert statuses(m)["engine"] == "cached" and statuses(m)["repo"] == "ran"


# ---- (c) cache, (d) atomic out dir ----------------------------------------------------------------
def test_second_build_reuses_stages_and_force_rebuilds(pair, tmp_path):
    root, _ = pair
    out, first = build(tmp_path, root)
    _, second = build(tmp_path, root)
    assert {k: v for k, v in statuses(second).items() if v != "not needed"} == {
        "check": "ran",  # always: its refusals read more options than its outputs depend on
        "engine": "cached",
        "repo": "cached",
    }
    assert (out / "engine" / "target" / "model.safetensors").is_file()
    # repo options only
    _, third = build(tmp_path, root, instance_count=2, decoupled=False, draft_cutoff=0.3, proposer="hybrid")
    assert statuses(third)["engine"] == "cached" and statuses(third)["repo"] == "ran"
    dflash_cfg = (out / "model_repo" / "dflash" / "config.pbtxt").read_text()
    assert 'key: "draft_length" value: { string_value: "block" }' in dflash_cfg and '"0.3"' in dflash_cfg
    assert 'key: "proposer" value: { string_value: "hybrid" }' in dflash_cfg
    assert "count: 2" in (out / "model_repo" / "dflash_unary" / "config.pbtxt").read_text()
    assert not (out / "model_repo" / "dflash_bls").exists() and (out / "model_repo" / "dflash").is_dir()
    # decoupled: false keeps the ensemble, over a unary engine model (HTTP /infer and gRPC ModelInfer work on it)
    assert "decoupled: false" in dflash_cfg and (out / "model_repo" / "ensemble" / "config.pbtxt").is_file()
    _, forced = build(tmp_path, root, "out", "--force", instance_count=2)
    assert {statuses(forced)[s] for s in ("check", "engine", "repo")} == {"ran"}


def test_build_and_serve_write_the_same_chat_template_default(pair, tmp_path, monkeypatch):
    """`build` and `serve --target/--drafter` serve the same apply_chat_template default: the tokenizer's chat
    template when it has one (serving/repo.py default_values), not true in one and false in the other (issue #30
    item 8); --no-chat / chat: false turns it off in both."""
    import dflash_trt.serving.cli as serving_cli

    root, _ = pair
    monkeypatch.setattr(serving_cli, "run", lambda *a, **k: 0)  # fill the repository, start no server

    def chat_default(repo: Path) -> str:
        text = (repo / "preprocessing" / "config.pbtxt").read_text()
        return text.split('key: "apply_chat_template" value: { string_value: "', 1)[1].split('"', 1)[0]

    out, _ = build(tmp_path, root)
    r = CliRunner().invoke(
        main,
        ["serve", "--target", str(root / "target"), "--drafter", str(root / "drafter"), "--out", str(tmp_path / "s")],
    )
    assert r.exit_code == 0, r.output
    assert chat_default(out / "model_repo") == chat_default(tmp_path / "s") == "true"  # the tiny tokenizer has one
    off, _ = build(tmp_path, root, "off", chat=False)
    assert chat_default(off / "model_repo") == "false"


def test_failed_or_interrupted_stage_leaves_no_or_the_old_out_dir(pair, tmp_path, monkeypatch):
    root, _ = pair
    import dflash_trt.deploy.stages as stages_mod  # the repo stage's fill_model_repo

    good = stages_mod.fill_model_repo

    def boom(*a, **k):
        raise RuntimeError("repo stage exploded")

    monkeypatch.setattr(stages_mod, "fill_model_repo", boom)
    cfg = write_yaml(tmp_path / "d.yaml", **base_fields(root))
    with pytest.raises(RuntimeError, match="exploded"):
        cli("--config", cfg, "--out", tmp_path / "out")
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path, "out")

    monkeypatch.setattr(stages_mod, "fill_model_repo", good)
    out, before = build(tmp_path, root)
    snapshot = (out / "build.json").read_text()

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(stages_mod, "fill_model_repo", interrupt)
    r = cli("--config", cfg, "--out", out, "--force")  # Ctrl-C during the repo stage
    assert r.exit_code == 1 and "Aborted" in r.output
    assert (out / "build.json").read_text() == snapshot and (out / "model_repo" / "dflash").is_dir()
    assert not leftovers(tmp_path, "out")


# ---- (e) tensorrt-llm (engine builds, removed upstream) is refused in one line ---------------------
@pytest.mark.parametrize("stage", [(), ("check",)])
def test_removed_tensorrt_llm_backend_is_one_line_and_writes_nothing(pair, tmp_path, stage):
    root, _ = pair
    cfg = write_yaml(tmp_path / "e.yaml", **base_fields(root, backend="tensorrt-llm"))
    r = cli(*stage, "--config", cfg, "--out", tmp_path / "out")
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert r.output.startswith("error: backend=tensorrt-llm: TensorRT-LLM no longer builds TensorRT engines")
    assert "use backend: trtllm-pytorch" in r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.yaml"]


# ---- (g) quantized build: eval numbers in build.json -----------------------------------------------
def test_quantized_build_reports_tau_and_agreement(pair, tmp_path):
    from dflash_trt.api import encode, load_drafter, load_target, load_tokenizer, stop_ids
    from dflash_trt.config import SamplingParams
    from dflash_trt.decoding.loop import generate
    from dflash_trt.deploy.hf_checkpoint import load_quantized_checkpoint
    from dflash_trt.deploy.quant_eval import BUILTIN_PROMPTS

    root, _ = pair
    out, manifest = build(
        tmp_path,
        root,
        target_quant="fp8",
        drafter_quant="nvfp4",
        sm="sm_100",
        calib_prompts=2,
        eval_prompts=3,
        eval_max_new_tokens=8,
    )
    assert statuses(manifest)["quantize"] == "ran" and statuses(manifest)["eval"] == "ran"
    ev = manifest["eval"]
    assert ev["prompts"] == 3
    # each pair's tau, recomputed here from its own greedy run on the same held-out prompts: the eval
    # reports the pairs it names (input folders vs the quantised ones), not just any run's tau
    tok = load_tokenizer(str(root / "target"))
    ids = [encode(tok, p, True) for p in BUILTIN_PROMPTS[:3]]
    params = SamplingParams(max_new_tokens=8, stop_token_ids=stop_ids(tok))

    def tau_of(target_dir, drafter_dir) -> float:
        t, _ = load_target(str(target_dir), "float32", progress=False)
        return generate(t, load_drafter(t, str(drafter_dir)), ids, params).stats.tau

    assert ev["tau_bf16"] == pytest.approx(tau_of(root / "target", root / "drafter"))
    assert ev["tau_quantized"] == pytest.approx(tau_of(out / "quantized" / "target", out / "quantized" / "drafter"))
    assert 1.0 <= ev["tau_bf16"] <= BLOCK and 1.0 <= ev["tau_quantized"] <= BLOCK
    for k in ("token_agreement", "prefix_agreement", "exact_match"):
        assert 0.0 <= ev[k] <= 1.0
    _, hf_qc, _ = load_quantized_checkpoint(out / "quantized" / "target")
    assert hf_qc["quantization"]["quant_algo"] == "FP8"
    qstate, hf_qc, _ = load_quantized_checkpoint(out / "engine" / "drafter")
    assert hf_qc["quantization"]["quant_algo"] == "NVFP4" and qstate["fc.weight"].dtype == torch.uint8
    assert "fc.input_scale" in qstate  # calibrated activation scale
    target, _ = load_target(str(out / "engine" / "target"), "float32", progress=False)  # dequantise on load
    assert isinstance(load_drafter(target, str(out / "engine" / "drafter")).config, DrafterConfig)
    # the serving loader reads the quantized engine folders too, with the same numerics as in-process
    from dflash_trt.config import SamplingParams
    from dflash_trt.decoding.loop import generate_baseline
    from dflash_trt.serving.engine_factory import load_engine_factory

    engine = load_engine_factory(str(out / "engine" / "target"), str(out / "engine" / "drafter"), dtype="float32")()
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    engine.add_request("r", [5, 6, 7], params)
    served = []
    while engine.has_unfinished():
        served += [t for o in engine.step() for t in o.new_token_ids]
    assert served == generate_baseline(target, [[5, 6, 7]], params).tokens[0]
