"""`dflash-trt serve`'s blocking loop: run a TritonServer until Ctrl-C / SIGTERM, then drain and stop.

Boundary: signals and the ready / stop lines only; the process itself is serving/server.py's TritonServer.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

from dflash_trt.serving.server import DEFAULT_GRACE_PERIOD, TritonServer
from dflash_trt.serving.triton_env import HOST
from dflash_trt.serving.triton_log import STUCK_UNLOAD_S


def serve(
    model_repo: str | Path,
    grpc_port: int = 8001,
    http_port: int = 8000,
    metrics_port: int = 8002,
    startup_timeout: float = 600.0,
    log_verbose: int = 0,
    echo=print,
    grace_period: float = DEFAULT_GRACE_PERIOD,
    on_ready=None,
    addresses: dict[str, str] | None = None,
) -> int:
    """`dflash-trt serve`: run tritonserver (loopback unless `addresses` names grpc_address / http_address /
    metrics_address) until Ctrl-C / SIGTERM, then drain (requests in
    flight get `grace_period` seconds; a second signal ends them at once) and stop; returns 0 when
    tritonserver exited cleanly, else 1. on_ready(server) -> str runs once the server is ready (e.g.
    the OpenAI API starts listening) and its text is added to the ready line."""
    srv = TritonServer(
        model_repo,
        grpc_port,
        http_port,
        metrics_port,
        startup_timeout,
        log_verbose,
        grace_period=grace_period,
        **(addresses or {}),
    )
    stop = {"now": False}

    def _on_signal(signum, frame):
        if stop["now"]:  # a second Ctrl-C / SIGTERM while draining: no more grace
            srv.hurry()
        stop["now"] = True

    main = threading.current_thread() is threading.main_thread()
    # Ctrl-C drains too (not a KeyboardInterrupt): the same clean stop as SIGTERM
    old = {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGTERM, signal.SIGINT)} if main else {}
    try:
        with srv:
            extra = on_ready(srv) if on_ready is not None else ""
            urls = f"gRPC {srv.grpc_url}  HTTP {srv.http_url}  metrics {srv.metrics_url}{extra}"
            if any(a != HOST for a in (srv.grpc_address, srv.http_address, srv.metrics_address)):
                urls += f"  (bound: {srv.bound()})"
            echo(f"ready: {urls}  (log {srv.log_path})")
            while not stop["now"]:
                if srv.proc is None or srv.proc.poll() is not None:
                    echo(f"tritonserver exited; log tail:\n{srv.log_tail()}")
                    return 1
                time.sleep(0.5)
            echo(
                f"stopping: requests in flight have {srv.grace_period:g} s to finish "
                "(Ctrl-C / SIGTERM again to end them now)"
            )
            srv.stop()
    except KeyboardInterrupt:  # not the main thread: no handler of ours; the context exit drains
        pass
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    if srv.stuck_models:  # nothing was in flight: a clean stop for every client (serving/triton_log.py)
        echo(
            f"stopped: Triton could not unload {', '.join(srv.stuck_models)} with nothing in flight (a request it "
            "refused on a gRPC stream that was then cancelled holds it; a Triton 2.51 gRPC frontend leak), so it "
            f"was ended after {STUCK_UNLOAD_S:g} s instead of waiting out its exit timeout"
        )
    elif srv.returncode not in (0, None):
        echo(f"tritonserver exited with code {srv.returncode} while stopping; log tail:\n{srv.stop_log_tail}")
        return 1
    return 0
