"""The stop protocol between `dflash-trt serve` (serving/server.py) and the engine model (triton_dflash.py).

Boundary: the drain file only. Triton hears SIGTERM, the engine model does not; and from SIGTERM on
Triton refuses every new request, internal ones too (the ensemble's next postprocessing step, a front
door's cancel), so streams in flight could not end cleanly after it. So first the server process writes
the grace period (seconds, a number) to the file named by $DFLASH_DRAIN_FILE, which it set in
tritonserver's environment (the backend stubs inherit it). The engine model's orchestrator polls it: from
then on new requests are refused, and those still running when the grace period is over end with
"server is shutting down". Once the engine has none left (its dflash_running_requests and
dflash_queued_requests metrics read 0), SIGTERM. A later, smaller number shortens the grace (a second
Ctrl-C writes 0). Anyone running tritonserver by hand can do the same.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

DRAIN_ENV = "DFLASH_DRAIN_FILE"


def write_drain_file(path: str | Path, grace: float) -> None:
    """Ask the engine model to drain: atomically, so its poll never reads half a number."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{max(grace, 0.0):g}\n")
    os.replace(tmp, path)


def drain_signal_from_env() -> Callable[[], float | None] | None:
    """For the engine model (inside the backend stub): a poll returning the grace seconds once the drain
    file exists, None before; None when the server was not started with $DFLASH_DRAIN_FILE."""
    path = os.environ.get(DRAIN_ENV)
    if not path:
        return None

    def poll() -> float | None:
        try:
            text = Path(path).read_text().strip()
        except FileNotFoundError:
            return None
        try:
            return float(text)
        except ValueError:  # not ours to guess: drain at once rather than run on
            return 0.0

    return poll
