"""Where tritonserver and its Python backend come from, and the addresses its endpoints bind.

Boundary: lookups only (no process is started here; serving/server.py does that). The binary is a
system `tritonserver` on PATH (GPU host / NGC container) or the one bundled in the PyPI package
`nvidia-pytriton`. Addresses: HOST (loopback) is every endpoint's default, so nothing outside this
machine reaches Triton's unauthenticated ports unless told to (docs/deploy.md, "Addresses and API key").
"""

from __future__ import annotations

import shutil
import socket
import sys
import sysconfig
from pathlib import Path

from dflash_trt.errors import DFlashError

HOST = "127.0.0.1"


class ServerError(DFlashError):
    """tritonserver is missing, failed to start, or did not become ready."""


def pytriton_root() -> Path | None:
    try:
        # deferred: optional dependency (the `serve` extra)
        import pytriton  # noqa: F401  (nvidia-pytriton)
    except ImportError:
        return None
    return Path(pytriton.__file__).parent


def find_tritonserver() -> Path:
    """The tritonserver binary: a system one on PATH if present, else nvidia-pytriton's."""
    system = shutil.which("tritonserver")
    if system:
        return Path(system)
    root = pytriton_root()
    if root is not None and (root / "tritonserver" / "bin" / "tritonserver").is_file():
        return root / "tritonserver" / "bin" / "tritonserver"
    raise ServerError(
        "tritonserver not found: install the serving extra (`pip install 'dflash-trt[serve]'`, "
        "which brings nvidia-pytriton's bundled server) or run inside an NGC Triton container"
    )


def free_port(host: str = HOST) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def local_host(address: str) -> str:
    """The address a client on this machine connects to for a server bound to `address`: a wildcard
    (all interfaces) is reached through loopback; IPv6 literals in brackets, for URLs."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(address, address)
    return f"[{host}]" if ":" in host else host


def libpython_dir() -> str:
    return sysconfig.get_config_var("LIBDIR") or str(Path(sys.base_prefix) / "lib")
