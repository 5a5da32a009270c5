"""`dflash-trt serve` and `dflash-trt client`: thin shells over serving/server.py and client.py."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import click

from dflash_trt.api import resolve_target_dir
from dflash_trt.cli_shared import friendly_errors
from dflash_trt.decoding.options import DEFAULT_PROPOSER
from dflash_trt.decoding.proposers import CHOICES
from dflash_trt.errors import DFlashError
from dflash_trt.hub.drafters import resolve_drafter
from dflash_trt.serving.client import DFlashClient
from dflash_trt.serving.openai_guard import API_KEY_ENV, DEFAULT_MAX_BODY_BYTES
from dflash_trt.serving.repo import default_template_dir, default_values, fill_model_repo, override_parameter
from dflash_trt.serving.serve_loop import serve as run
from dflash_trt.serving.server import DEFAULT_GRACE_PERIOD
from dflash_trt.serving.triton_env import HOST, local_host


def network_options(f):
    """serve's addresses (Triton's own endpoints have no authentication: keep them where only trusted
    callers reach them, docs/deploy.md) and the OpenAI API's key and body bound (applied bottom-up, so
    --help lists them in the order below)."""
    f = click.option(
        "--openai-max-body-bytes",
        default=DEFAULT_MAX_BODY_BYTES,
        show_default=True,
        type=click.IntRange(1),
        help="Largest OpenAI request body accepted; a larger one gets HTTP 413.",
    )(f)
    f = click.option(
        "--api-key",
        envvar=API_KEY_ENV,
        default=None,
        help=f"Key the OpenAI API requires as 'Authorization: Bearer <key>' on /v1 (/health stays open); "
        f"or set ${API_KEY_ENV}.",
    )(f)
    for name, what in (("metrics", "metrics"), ("http", "HTTP"), ("grpc", "gRPC")):
        f = click.option(
            f"--{name}-address",
            default=HOST,
            show_default=True,
            help=f"Address Triton's {what} endpoint binds (0.0.0.0: all interfaces; Triton checks no credentials).",
        )(f)
    return f


def register(main: click.Group) -> None:
    @main.command()
    @click.option("--model-repo", default=None, help="A filled model repository (from `dflash-trt build`).")
    @click.option("--target", default=None, help="Or: target name/folder, to fill a repository on the fly.")
    @click.option(
        "--drafter", "drafter_dir", default=None, help="Drafter folder or bundled drafter name (with --target)."
    )
    @click.option("--out", default=None, help="Where to write the on-the-fly repository (default: a temp dir).")
    @click.option("--grpc-port", default=8001, show_default=True, type=int)
    @click.option("--http-port", default=8000, show_default=True, type=int)
    @click.option("--metrics-port", default=8002, show_default=True, type=int)
    @click.option(
        "--openai-port",
        default=None,
        type=click.IntRange(0, 65535),
        help="Also serve an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions) on this port.",
    )
    @click.option(
        "--openai-host",
        default=HOST,
        show_default=True,
        help="Address the OpenAI API binds (0.0.0.0: all interfaces; set --api-key then).",
    )
    @network_options
    @click.option(
        "--served-model-name",
        default=None,
        help="Model id of the OpenAI API (default: the --target name, else the target folder's name).",
    )
    @click.option(
        "--grace-period",
        default=DEFAULT_GRACE_PERIOD,
        show_default=True,
        type=click.FloatRange(0, 86400, max_open=True),
        help="Seconds requests in flight may still run after Ctrl-C / SIGTERM; then each gets a "
        "'server is shutting down' error. A second Ctrl-C ends them at once.",
    )
    @click.option(
        "--proposer",
        default=None,
        type=click.Choice(list(CHOICES)),
        help="Override the repository's proposer for this run (the same build; none = plain decoding, no "
        "drafts). Default: the one it was built with.",
    )
    @friendly_errors
    def serve(
        model_repo,
        target,
        drafter_dir,
        out,
        grpc_port,
        http_port,
        metrics_port,
        openai_port,
        openai_host,
        served_model_name,
        grace_period,
        proposer,
        grpc_address,
        http_address,
        metrics_address,
        api_key,
        openai_max_body_bytes,
    ):
        """Start Triton Inference Server (on 127.0.0.1 unless the address options say otherwise) with the
        DFlash models; Ctrl-C stops it."""
        if model_repo is None:
            if not (target and drafter_dir):
                raise DFlashError("give --model-repo DIR, or --target and --drafter to build one on the fly")
            drafter_dir = resolve_drafter(drafter_dir)

            out = out or tempfile.mkdtemp(prefix="dflash-repo-")
            model_repo = fill_model_repo(
                default_template_dir(),
                out,
                default_values(resolve_target_dir(target), drafter_dir, proposer=proposer or DEFAULT_PROPOSER),
            )
        elif proposer is not None:  # a view of the built repository with the engine's proposer changed
            model_repo = override_parameter(model_repo, tempfile.mkdtemp(prefix="dflash-repo-"), "proposer", proposer)
        api = None
        if openai_port is not None:
            # deferred: fastapi/uvicorn (the `serve` extra) load only when the API is asked for
            from dflash_trt.serving.openai_api import OpenAIFrontend

            if not api_key and openai_host not in ("127.0.0.1", "::1", "localhost"):
                click.echo(
                    f"warning: the OpenAI API on {openai_host} takes requests from anyone: set --api-key", err=True
                )
            if served_model_name is None and target and not Path(target).expanduser().is_dir():
                served_model_name = target  # a known model name, not its cache folder's
            # built before Triton starts, so a bad tokenizer folder fails at once; listens once Triton is ready
            api = OpenAIFrontend(
                model_repo,
                f"{local_host(grpc_address)}:{grpc_port}",
                openai_host,
                openai_port,
                served_model_name,
                api_key,
                openai_max_body_bytes,
            )
        try:
            code = run(
                model_repo,
                grpc_port,
                http_port,
                metrics_port,
                echo=click.echo,
                grace_period=grace_period,
                on_ready=api.on_ready if api is not None else None,
                addresses=dict(grpc_address=grpc_address, http_address=http_address, metrics_address=metrics_address),
            )
        finally:
            if api is not None:
                api.stop()
        raise SystemExit(code)

    @main.command()
    @click.option("--url", default="127.0.0.1:8001", show_default=True)
    @click.option("--prompt", required=True)
    @click.option("--stream", is_flag=True, help="Stream tokens as they are accepted.")
    @click.option("--max-tokens", default=128, show_default=True, type=int)
    @click.option("--temperature", default=0.0, show_default=True, type=float, help="0 = greedy (lossless, exact)")
    @click.option("--top-k", default=0, show_default=True, type=int, help="0 = off")
    @click.option("--top-p", default=1.0, show_default=True, type=float)
    @click.option("--seed", default=None, type=int, help="Per-request sampling seed (reproducible sampled output).")
    @click.option("--stop", "stop_words", multiple=True, help="Stop string (repeatable).")
    @click.option("--chat/--no-chat", default=None, help="Override the repository's chat-template default.")
    @click.option("--json", "as_json", is_flag=True)
    @friendly_errors
    def client(url, prompt, stream, max_tokens, temperature, top_k, top_p, seed, stop_words, chat, as_json):
        """Send one request to a running `dflash-trt serve` over gRPC."""
        c = DFlashClient(url)
        kw = {
            "top_k": top_k,
            "top_p": top_p,
            "seed": seed,
            "stop_words": list(stop_words) or None,
            "apply_chat_template": chat,
        }
        if stream:  # text as it is accepted; --json: one object per chunk (text + statistics)
            last = {}
            for chunk in c.stream(prompt, max_tokens=max_tokens, temperature=temperature, **kw):
                click.echo(json.dumps(chunk) if as_json else chunk["text"], nl=as_json)
                last = chunk
            if not as_json:
                click.echo()
                _stats(last)
            return
        res = c.generate(prompt, max_tokens=max_tokens, temperature=temperature, **kw)
        if as_json:
            click.echo(json.dumps(res))
        else:
            click.echo(res["text"])
            _stats(res)

    def _stats(res: dict) -> None:
        if res.get("acceptance_length") is not None:
            click.echo(
                f"[{res.get('num_output_tokens')} tokens, finish {res.get('finish_reason')}, "
                f"acceptance length {res['acceptance_length']:.2f}, "
                f"accepted drafts {res.get('total_accepted_draft_tokens')}/{res.get('total_draft_tokens')}]",
                err=True,
            )
