"""Start and stop a real `tritonserver` for a filled model repository (loopback unless told otherwise).

Boundary: process management only. `find_tritonserver()` picks the binary (a system
`tritonserver` on PATH — GPU host / NGC container — else the one bundled in the PyPI package
`nvidia-pytriton`); `TritonServer` prepares the Python-backend directory and the environment the
backend stub needs, starts the server, waits for `/v2/health/ready`, and always stops it
(context exit + atexit). `serve()` is the blocking `dflash-trt serve`.

Stopping (issue #30): Triton on SIGTERM refuses every new request, internal ones too (the
ensemble's next step, a front door's cancel), and waits for in-flight requests before it unloads
models; but only the engine model can end a long generation, and it hears nothing of the SIGTERM.
So `stop()` first writes the drain file (serving/drain.py): the engine model refuses new requests
and ends those still running after the grace period with "server is shutting down". Once its
metrics show none left, SIGTERM; Triton's --exit-timeout-secs covers the models' unload, SIGKILL
only after that. The Python backend's shared-memory regions carry a per-run prefix, so the ones
a killed run leaves in /dev/shm are removed, and no one else's.

Environment facts the bundled server needs (measured with nvidia-pytriton 0.7.0 / Triton 2.51):
  * the Python-backend stub embeds libpython and runs isolated: PYTHONPATH is ignored and it
    finds site-packages through the first `python3` on PATH, so this interpreter's bin dir goes
    first on PATH (dflash_trt must be installed in that environment, e.g. `pip install -e .`);
  * LD_LIBRARY_PATH must hold `nvidia_pytriton.libs` and the directory of this interpreter's own
    libpython, or the stub loads another libpython and dies with
    "'_thread.RLock' object has no attribute '_recursion_count'";
  * the stub matching this interpreter's version must sit next to `libtriton_python.so`, so the
    backend directory is copied into a temp dir with that stub.
"""

from __future__ import annotations

import atexit
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from dflash_trt.serving.drain import DRAIN_ENV, write_drain_file
from dflash_trt.serving.triton_env import (  # noqa: F401  (ServerError, free_port: part of this module's API)
    HOST,
    ServerError,
    find_tritonserver,
    free_port,
    libpython_dir,
    local_host,
    pytriton_root,
)
from dflash_trt.serving.triton_log import UnloadWatch, loaded_models, unloaded_models

DEFAULT_GRACE_PERIOD = 10.0  # seconds in-flight requests may still run after a stop
UNLOAD_MARGIN = 30  # seconds Triton gets beyond the grace to unload: the engine loop may be mid-step
KILL_MARGIN = 10  # seconds past Triton's own exit timeout before SIGKILL
DRAIN_MARGIN = 5  # seconds past the grace to wait for the engine's last requests (a step in progress) to end
SHM_DIR = Path("/dev/shm")


class TritonServer:
    """`with TritonServer(repo) as srv:` -> srv.grpc_url, srv.http_url, srv.metrics_url."""

    def __init__(
        self,
        model_repo: str | Path,
        grpc_port: int | None = None,
        http_port: int | None = None,
        metrics_port: int | None = None,
        startup_timeout: float = 180.0,
        log_verbose: int = 0,
        binary: str | Path | None = None,
        extra_args: list[str] | None = None,
        grace_period: float = DEFAULT_GRACE_PERIOD,
        grpc_address: str = HOST,
        http_address: str = HOST,
        metrics_address: str = HOST,
    ):
        if not isinstance(grace_period, (int, float)) or not 0 <= grace_period < 86400:
            raise ServerError(
                f"grace_period={grace_period!r}: must be 0 or more seconds (how long in-flight requests "
                "may still run once the server is asked to stop)"
            )
        self.model_repo = Path(model_repo).resolve()
        if not self.model_repo.is_dir():
            raise ServerError(f"model repository {self.model_repo}: not a folder (fill one with fill_model_repo)")
        # Triton's own endpoints have no authentication: bind them where only trusted callers reach them
        self.grpc_address, self.http_address, self.metrics_address = grpc_address, http_address, metrics_address
        self.grpc_port = grpc_port or free_port(grpc_address)
        self.http_port = http_port or free_port(http_address)
        self.metrics_port = metrics_port or free_port(metrics_address)
        self.startup_timeout = startup_timeout
        self.log_verbose = log_verbose
        self.binary = Path(binary) if binary else find_tritonserver()
        self.extra_args = list(extra_args or [])
        self.grace_period = float(grace_period)
        # Triton's own wait on stop: the models' unload, plus the grace in case the engine's metrics were unreadable
        self.exit_timeout = math.ceil(self.grace_period) + UNLOAD_MARGIN
        # this run's Python-backend shared-memory regions: /dev/shm/<prefix><uuid>, so they can be told apart
        self.shm_prefix = f"dflash_{os.getpid()}_{secrets.token_hex(4)}_"
        self.proc: subprocess.Popen | None = None
        self.returncode: int | None = None  # tritonserver's, once stopped
        self.stop_log_tail = ""  # the log tail of a run that did not exit 0 (its log folder is removed)
        # models Triton could not unload with nothing in flight (serving/triton_log.py): the process was ended
        self.stuck_models: list[str] = []
        self._workdir: Path | None = None
        self.log_path: Path | None = None
        self._log = None

    # ---- endpoints ----------------------------------------------------------------------
    # what a client on this machine connects to (a server bound to all interfaces: through loopback)
    @property
    def grpc_url(self) -> str:
        return f"{local_host(self.grpc_address)}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://{local_host(self.http_address)}:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{local_host(self.metrics_address)}:{self.metrics_port}/metrics"

    def bound(self) -> str:
        """Where each endpoint listens, for the ready line (address:port)."""
        return (
            f"gRPC {self.grpc_address}:{self.grpc_port}  HTTP {self.http_address}:{self.http_port}  "
            f"metrics {self.metrics_address}:{self.metrics_port}"
        )

    # ---- environment --------------------------------------------------------------------
    def _bundled(self) -> bool:
        root = pytriton_root()
        return root is not None and self.binary.resolve().is_relative_to(root.resolve())

    def _prepare_backends(self) -> list[str]:
        """Copy the bundled python backend next to the stub matching this interpreter."""
        if not self._bundled():
            return []  # a system/NGC server ships its own backends and stub
        dist = pytriton_root() / "tritonserver"
        ver = f"{sys.version_info.major}.{sys.version_info.minor}"
        stub = dist / "python_backend_stubs" / ver / "triton_python_backend_stub"
        if not stub.is_file():
            raise ServerError(f"{stub}: nvidia-pytriton has no Python-backend stub for Python {ver}")
        backends = self._workdir / "backends"
        shutil.copytree(dist / "backends", backends, ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy2(stub, backends / "python" / "triton_python_backend_stub")
        return [f"--backend-directory={backends}", f"--cache-directory={dist / 'caches'}"]

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        libs = [libpython_dir()]
        root = pytriton_root()
        if root is not None and self._bundled():
            libs.insert(0, str(root.parent / "nvidia_pytriton.libs"))
        if env.get("LD_LIBRARY_PATH"):
            libs.append(env["LD_LIBRARY_PATH"])
        env["LD_LIBRARY_PATH"] = os.pathsep.join(libs)
        env.pop("PYTHONPATH", None)  # ignored by the isolated stub anyway; avoid confusing the server
        env[DRAIN_ENV] = str(self.drain_path)  # the stubs inherit the server's environment
        return env

    @property
    def drain_path(self) -> Path | None:
        return None if self._workdir is None else self._workdir / "drain"

    def command(self, backend_args: list[str]) -> list[str]:
        return [
            str(self.binary),
            f"--model-repository={self.model_repo}",
            f"--http-address={self.http_address}",
            f"--http-port={self.http_port}",
            f"--grpc-address={self.grpc_address}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.metrics_address}",
            f"--metrics-port={self.metrics_port}",
            "--allow-metrics=true",
            f"--exit-timeout-secs={self.exit_timeout}",
            "--strict-readiness=true",
            f"--log-verbose={self.log_verbose}",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            *backend_args,
            *self.extra_args,
        ]

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self) -> TritonServer:
        if self.proc is not None:
            return self
        self._workdir = Path(tempfile.mkdtemp(prefix="dflash-triton-"))
        self.log_path = self._workdir / "tritonserver.log"
        try:
            cmd = self.command(self._prepare_backends())
            self._log = open(self.log_path, "wb")
            self.proc = subprocess.Popen(
                cmd,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=self._env(),
                cwd=self._workdir,
                start_new_session=True,
            )
            atexit.register(self.stop)
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(
                    f"tritonserver exited with code {self.proc.returncode} during startup; "
                    f"log tail:\n{self.log_tail()}"
                )
            if self.is_ready():
                return
            time.sleep(0.25)
        raise ServerError(f"tritonserver not ready after {self.startup_timeout:.0f}s; log tail:\n{self.log_tail()}")

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, lines: int = 25) -> str:
        """Error lines of the server log (model load failures, tracebacks), then its last lines."""
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        all_lines = self.log_path.read_text(errors="replace").splitlines()
        noise = ("cuda", "nvml", "dcgm", "gpu metrics")
        errors = [
            ln
            for ln in all_lines
            if (ln.startswith("E") or "Error" in ln or "Exception" in ln) and not any(n in ln.lower() for n in noise)
        ]
        tail = all_lines[-lines:]
        head = [ln for ln in errors[-20:] if ln not in tail]
        return "\n".join(head + (["..."] if head else []) + tail)

    def hurry(self) -> None:
        """During stop(): end the grace period now (in-flight requests get their error at once)."""
        if self.drain_path is not None and self.drain_path.exists():
            write_drain_file(self.drain_path, 0.0)

    def stop(self) -> None:
        """Drain, then stop: the engine model refuses new requests and ends those still running after
        grace_period seconds with an error; once it has none left, SIGTERM lets Triton unload the models
        and exit; SIGKILL (the whole group) only if it has not exited within its exit timeout plus a
        margin. Removes this run's leftover shared memory and temp folder; idempotent."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            try:
                write_drain_file(self.drain_path, self.grace_period)
                # before the SIGTERM: Triton then refuses every new request, also the ensemble's next
                # postprocessing step and a front door's cancel, so the streams in flight could not end
                self._wait_drained(proc, self.grace_period + DRAIN_MARGIN)
            except OSError:  # the temp folder is gone: Triton's own exit timeout still bounds the wait
                pass
            for sig, wait in ((signal.SIGTERM, self.exit_timeout + KILL_MARGIN), (signal.SIGKILL, 10.0)):
                try:
                    if sig == signal.SIGTERM:  # the server alone: it stops its backend stubs itself, in order
                        logged = self.log_path.stat().st_size if self.log_path.exists() else 0
                        proc.send_signal(sig)
                    else:
                        os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                if sig == signal.SIGTERM and self._wait_unload(proc, wait, logged):
                    break
                if sig == signal.SIGKILL:
                    try:
                        proc.wait(wait)
                    except subprocess.TimeoutExpired:
                        pass
        if proc is not None:
            try:  # stubs of a killed server: their group is the server's session
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.returncode = proc.poll()
            self._remove_shared_memory()
            if self.returncode != 0 and not self.stuck_models:
                self.stop_log_tail = self.log_tail()
        if self._log is not None:
            self._log.close()
            self._log = None
        atexit.unregister(self.stop)
        if self._workdir is not None and not os.environ.get("DFLASH_KEEP_TRITON_LOGS"):
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    def _wait_unload(self, proc: subprocess.Popen, timeout: float, logged: int) -> bool:
        """After the SIGTERM: True once tritonserver exited, or once its unload is stuck with nothing in
        flight (triton_log.py: a model held by a refused request of a cancelled gRPC stream, which
        Triton 2.51 frees only after the wait it would run to its exit timeout); then the whole group is
        ended here and self.stuck_models names the models. False when the timeout passed."""
        watch, deadline = UnloadWatch(), time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                proc.wait(0.25)
                return True
            except subprocess.TimeoutExpired:
                pass
            log = self.log_path.read_bytes()[logged:].decode(errors="replace") if self.log_path.exists() else ""
            if watch.update(log, time.monotonic()):
                every = loaded_models(self.log_path.read_text(errors="replace"))
                self.stuck_models = sorted(every - unloaded_models(log)) or ["(unnamed)"]
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10.0)
                return True
        return False

    def _engine_requests(self) -> int | None:
        """Requests the engine model still runs or queues (its metrics); None without any to read."""
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=2) as r:
                text = r.read().decode()
        except (urllib.error.URLError, OSError):
            return None
        counts = re.findall(r"^dflash_(?:running|queued)_requests\{[^}]*\} (\S+)$", text, re.M)
        return round(sum(float(c) for c in counts)) if counts else None

    def _wait_drained(self, proc: subprocess.Popen, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            left = self._engine_requests()
            if not left:  # none left (or no engine model): the front doors' last relays take a moment
                time.sleep(0.5)
                return
            time.sleep(0.2)

    def _remove_shared_memory(self) -> None:
        """Remove the /dev/shm regions named with this run's prefix (a clean exit leaves none; a killed
        server or stub leaves its own); other servers' regions are not touched."""
        for region in SHM_DIR.glob(f"{self.shm_prefix}*") if SHM_DIR.is_dir() else []:
            region.unlink(missing_ok=True)

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
