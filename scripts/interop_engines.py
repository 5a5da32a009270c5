"""Worker of scripts/interop_check.py: load emitted folders with vLLM 0.33's / SGLang 0.5.23's own code on CPU.

Boundary: runs inside the interop venv (vllm + sglang installed --no-deps, see interop_check.py); reads
a jobs JSON written by interop_check.py (each job: the serve/<engine>.sh to parse, our reference tensors,
the values the engine must derive) and writes one result per job. It never imports dflash_trt: the
reference tensors were dequantized by our code, and this file decodes the engine's parameters with its
own reading of the Model Optimizer formats, so the two sides are independent.

Per job: the engine's own CLI parser and config objects turn the emitted command into its runtime
config; its own model loader builds and loads target and drafter; each model's parameters are
recorded after load_weights and BEFORE process_weights_after_loading (the post-processing repacks for
GPU kernels that do not exist on CPU). Sources relied on (paths in the installed packages):
  vLLM   engine/arg_utils.py EngineArgs.add_cli_args / from_cli_args / create_engine_config;
         model_executor/model_loader/__init__.py get_model, base_loader.py:62-110 (load then process);
         v1/worker/gpu/spec_decode/__init__.py:14-58 init_speculator (V2 runner: DFlash2Speculator for
         DFlash2DraftModel, DSparkSpeculator for method dspark), dflash/speculator.py:239-244 and
         dspark/speculator.py:84-89 load_draft_model; eagle/eagle3_utils.py:113-124 aux layers = ids + 1.
  SGLang server_args.py ServerArgs.add_cli_args / from_cli_args, set_global_server_args_for_scheduler;
         configs/model_config.py:924 ModelConfig.from_server_args(is_draft_model=True);
         model_loader/__init__.py:23 get_model, loader.py:1079-1090 DefaultModelLoader.postprocess_weights.
"""

from __future__ import annotations

import json
import shlex
import socket
import sys
import traceback
from pathlib import Path

import interop_stubs  # noqa: F401  (environment + stand-ins before the engines import)
import torch
from safetensors.torch import load_file

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
SCALE_LEAVES = ("weight_scale", "weight_scale_2", "input_scale", "k_scale", "v_scale")
VOCAB_ROWS = ("embed_tokens", "lm_head", "markov_w")  # tensors with one row per token
SHARED = ("embed_tokens", "lm_head", "mask_embedding", "draft_id_to_target_id", "rotary_emb")
SNAPSHOTS: list[dict] = []  # one per model whose weights were loaded: name -> tensor, + fused widths


def script_argv(script: str) -> list[str]:
    text = Path(script).read_text()
    return shlex.split(text[text.index("exec ") + 5 :].replace("\\\n", " "))


def snapshot(model) -> None:
    """Record the loaded parameters and each linear's output partition sizes (per fused shard)."""
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    widths = {}
    for name, mod in model.named_modules():
        w = getattr(mod, "logical_widths", None) or getattr(mod, "output_partition_sizes", None)
        if w:
            widths[name] = [int(x) for x in w]
    # heads the engine leaves unbuilt in this configuration (SGLang: no confidence head in its default
    # static verify mode, models/dspark.py:487-489), whose tensors it skips by design
    unbuilt = [
        f"{h}."
        for h in ("confidence_head", "markov_head")
        for owner in (model, getattr(model, "model", None))
        if owner is not None and hasattr(owner, h) and getattr(owner, h) is None
    ]
    SNAPSHOTS.append({"state": state, "widths": widths, "cls": type(model).__name__, "unbuilt": unbuilt})


# ---- decoding the engine's parameters -----------------------------------------------------------
def _rows(widths, i):
    start = sum(widths[:i])
    return slice(start, start + widths[i])


def dequant(state: dict, m: str, widths: list[int] | None) -> torch.Tensor:
    """The engine's weight of module m as float32 [out, in], from its stored codes and scales."""
    w = state[f"{m}.weight"]
    if w.dtype == torch.float8_e4m3fn:
        s = state.get(f"{m}.weight_scale")
        out = w.float()
        if s is None:
            return out
        s = s.float().reshape(-1)
        widths = widths if widths and len(widths) == s.numel() else [w.shape[0]] * (s.numel() == 1)
        if s.numel() == w.shape[0] and len(widths) != s.numel():  # per-channel
            return out * s[:, None]
        for i, _ in enumerate(widths):
            out[_rows(widths, i)] *= s[i]
        return out
    if w.dtype == torch.uint8 and f"{m}.weight_scale_2" in state:  # NVFP4: low nibble first
        codes = torch.stack([w & 0x0F, w >> 4], dim=-1).flatten(-2).long()
        vals = E2M1[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
        block = state[f"{m}.weight_scale"].float()[: w.shape[0], : vals.shape[1] // 16]
        vals = vals.unflatten(-1, (-1, 16)) * block[..., None]
        g = state[f"{m}.weight_scale_2"].float().reshape(-1)
        widths = widths if widths and len(widths) == g.numel() else [w.shape[0]]
        for i, _ in enumerate(widths):
            vals[_rows(widths, i)] *= g[i]
        return vals.flatten(-2)
    return w.float()


def destinations(ref_name: str, state: dict) -> list[tuple[str, int | None]]:
    """Where the engine keeps our tensor `ref_name`: (engine name, fused shard index or None)."""
    mod, _, leaf = ref_name.rpartition(".")
    parent, _, last = mod.rpartition(".")
    cands = [(mod, None)]
    for fused, parts in FUSED.items():
        if last in parts:
            cands.append((f"{parent}.{fused}" if parent else fused, parts.index(last)))
    if leaf in ("k_scale", "v_scale"):  # vLLM / SGLang keep the KV scales on the attention module
        cands.append((f"{parent}.attn", None))
    out = []
    for m, shard in cands:
        for name in (m, f"model.{m}", m.removeprefix("model.")):
            if f"{name}.{leaf}" in state:
                out.append((name, shard))
    return out


def close(engine: torch.Tensor, ours: torch.Tensor, name: str = "") -> str | None:
    """None when equal up to the engine's storage rounding (bf16: 2^-8 relative), else what differs."""
    engine, ours = engine.float(), ours.float()
    if any(v in name for v in VOCAB_ROWS) and engine.dim() == 2 and engine.shape[0] > ours.shape[0]:
        engine = engine[: ours.shape[0]]  # the engine pads vocabulary rows to a multiple of 64
    if engine.shape != ours.shape:
        return f"shape {tuple(engine.shape)} vs ours {tuple(ours.shape)}"
    if not torch.isfinite(engine).all():
        return "non-finite values"
    tol = 2.0**-8 * ours.abs() + 1e-6 * ours.abs().max().clamp_min(1e-30)
    if ((engine - ours).abs() <= tol).all():
        return None
    ratio = engine.abs().mean() / ours.abs().mean().clamp_min(1e-30)
    return f"differs (engine/ours magnitude {ratio:.3g}x, max abs err {(engine - ours).abs().max():.3g})"


def compare(snap: dict, ref: dict[str, torch.Tensor], what: str, kv_scales: bool = True) -> list[str]:
    """Every reference tensor (our dequantized weights, our scales) lands where the engine reads it.
    kv_scales False (a bf16 KV cache): the engines' k_scale / v_scale placeholders stay at their
    never-read sentinel (vLLM -1), so they are not checked."""
    state, widths, problems = snap["state"], snap["widths"], []
    for name, ours in sorted(ref.items()):
        leaf = name.rpartition(".")[2]
        dests = destinations(name, state)
        if not dests:
            if any(name.startswith(u) for u in snap.get("unbuilt", ())):
                continue
            if not any(s in name for s in SHARED):
                problems.append(f"{what} {name}: not in the engine's model (dropped)")
            continue
        m, shard = dests[0]
        if leaf == "weight":
            got = dequant(state, m, widths.get(m))
            if shard is not None:
                got = got[_rows(widths[m], shard)]
        else:
            got = state[f"{m}.{leaf}"].float()
            if shard is not None and got.numel() == len(widths.get(m, [])):
                got = got.reshape(-1)[shard]
            elif shard is not None and got.dim() and got.shape[0] == sum(widths[m]):
                got = got[_rows(widths[m], shard)]
            got = got.reshape(ours.shape) if got.numel() == ours.numel() else got
        err = close(got, ours, name)
        if err:
            problems.append(f"{what} {name} -> {m}.{leaf}: {err}")
    for name, t in state.items():
        leaf = name.rpartition(".")[2]
        if leaf in SCALE_LEAVES and t.is_floating_point() and (kv_scales or leaf not in ("k_scale", "v_scale")):
            bad = ~torch.isfinite(t.float()) | (t.float() <= 0) | (t.float() <= torch.finfo(torch.float32).min)
            if bad.any():
                problems.append(f"{what} {name}: scale never loaded ({t.float().reshape(-1)[0].item():.3g})")
    return problems


# ---- the engines ------------------------------------------------------------------------------------
def _port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def run_vllm(job: dict) -> dict:
    import vllm.model_executor.model_loader.base_loader as base_loader
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.worker.gpu.spec_decode import init_speculator
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

    real = base_loader.process_weights_after_loading

    def record_then_process(model, model_config, device):
        snapshot(model)
        try:  # repacking for GPU kernels: vllm._C ops absent on CPU; the snapshot is what loading gave
            real(model, model_config, device)
        except Exception:  # noqa: BLE001  (not part of the check)
            pass

    base_loader.process_weights_after_loading = record_then_process
    interop_stubs.no_nvfp4_gemm_on_cpu()
    argv = script_argv(job["script"])
    assert argv[:2] == ["vllm", "serve"], argv[:2]
    args = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(["--model", argv[2], *argv[3:]])
    cfg = EngineArgs.from_cli_args(args).create_engine_config()
    sc = cfg.speculative_config
    aux = get_eagle3_aux_layers_from_config(sc) or ()
    derived = {
        "method": sc.method,
        "num_drafts": sc.num_speculative_tokens,
        "architectures": list(sc.draft_model_config.architectures),
        "target_layer_ids": [i - 1 for i in aux],
        "quantization": [cfg.model_config.quantization, sc.draft_model_config.quantization],
    }
    problems = []
    with set_current_vllm_config(cfg):
        if not model_parallel_is_initialized():
            init_distributed_environment(1, 0, f"tcp://127.0.0.1:{_port()}", 0, "gloo")
            initialize_model_parallel(1, 1)
        SNAPSHOTS.clear()
        target = get_model(vllm_config=cfg)
        try:
            spec = init_speculator(cfg, torch.device("cpu"), None)
        except Exception as e:  # noqa: BLE001  (the runner refusing the drafter IS a result)
            problems.append(f"V2 runner refuses the drafter: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
            spec = None
        if spec is not None:
            derived["speculator"] = type(spec).__name__
            spec.load_draft_model(target, set())
        else:  # still check the tensors, through the loader that speculator would have called
            from vllm.v1.worker.gpu.spec_decode.dflash.utils import load_dflash_model
            from vllm.v1.worker.gpu.spec_decode.dspark.utils import load_dspark_model

            (load_dspark_model if sc.method == "dspark" else load_dflash_model)(target, cfg)
    derived["drafter_class"] = SNAPSHOTS[-1]["cls"]
    return {"derived": derived, "problems": problems}


def run_sglang(job: dict) -> dict:
    import argparse

    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import parallel_state
    from sglang.srt.model_loader import get_model
    from sglang.srt.model_loader.loader import DefaultModelLoader
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    real = DefaultModelLoader.postprocess_weights

    def record_then_process(model, target_device):
        snapshot(model)
        try:  # requantization kernels (sgl_kernel) absent on CPU; the snapshot is what loading gave
            real(model, target_device)
        except Exception:  # noqa: BLE001  (not part of the check)
            pass

    DefaultModelLoader.postprocess_weights = staticmethod(record_then_process)
    argv = script_argv(job["script"])
    assert argv[:3] == ["python", "-m", "sglang.launch_server"], argv[:3]
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    # --device cuda: the serving host's device (DSPARK / DFLASH refuse a CPU device in the arg hooks)
    sa = ServerArgs.from_cli_args(parser.parse_args([*argv[3:], "--device", "cuda"]))
    # the scheduler process's own set-up, rank 0 of 1 (managers/scheduler.py:6325-6335)
    publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=None, gpu_id=None))
    algo = str(sa.speculative_algorithm)
    block = sa.speculative_dspark_block_size if "DSPARK" in algo else sa.speculative_dflash_block_size
    derived = {
        "method": algo,
        "block_size": block,
        "num_draft_tokens": sa.speculative_num_draft_tokens,
        "quantization": [sa.quantization, sa.speculative_draft_model_quantization],
    }
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.init_distributed_environment(1, 0, f"tcp://127.0.0.1:{_port()}", 0, "gloo")
        parallel_state.initialize_model_parallel()
    SNAPSHOTS.clear()
    load, dev = LoadConfig(load_format=sa.load_format), DeviceConfig("cpu")
    target_mc = ModelConfig.from_server_args(sa)
    get_model(model_config=target_mc, load_config=load, device_config=dev)
    draft_mc = ModelConfig.from_server_args(sa, model_path=sa.speculative_draft_model_path, is_draft_model=True)
    drafter = get_model(model_config=draft_mc, load_config=load, device_config=dev)
    derived["architectures"] = list(draft_mc.hf_config.architectures)
    derived["drafter_class"] = type(drafter).__name__
    dcfg = getattr(drafter, "draft_config", None)
    if dcfg is not None and hasattr(dcfg, "resolve_target_layer_ids"):
        n = int(drafter.config.num_hidden_layers)
        derived["target_layer_ids"] = list(
            dcfg.resolve_target_layer_ids(target_num_layers=target_mc.num_hidden_layers, draft_num_layers=n)
        )
    return {"derived": derived, "problems": []}


def run_job(job: dict) -> dict:
    try:
        res = (run_vllm if job["engine"] == "vllm" else run_sglang)(job)
    except Exception as e:  # noqa: BLE001  (one job's failure is its row, not the run's end)
        tb = traceback.format_exc().strip().splitlines()
        return {"name": job["name"], "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}", "tb": tb[-6:]}
    if len(SNAPSHOTS) < 2:
        res["problems"].append(f"only {len(SNAPSHOTS)} model(s) went through the engine's loader")
    else:
        target, drafter = SNAPSHOTS[0], SNAPSHOTS[-1]
        kv = job.get("kv_scales", True)
        res["problems"] += compare(target, load_file(job["ref_target"]), "target", kv)
        res["problems"] += compare(drafter, load_file(job["ref_drafter"]), "drafter", kv)
    res["name"] = job["name"]
    return res


def main(argv: list[str]) -> int:
    jobs = json.loads(Path(argv[1]).read_text())
    results = [run_job(j) for j in jobs]
    Path(argv[2]).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
