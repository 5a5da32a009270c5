"""Clocks the benchmark methods time Hugging Face generate() with: a streamer that stamps every target
pass (PassClock) and forward hooks that stamp every call of a module (ForwardTimer), each after a device
sync (`sync`), so that GPU times are the work's, not the launches'.

Boundary: timing only; what is timed is bench/methods.py's business.
"""

from __future__ import annotations

import time

import torch


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


class PassClock:
    """A transformers streamer (duck-typed BaseStreamer): put() once for the prompt, then once per
    target pass with the tokens that pass emitted."""

    def __init__(self):
        self.events: list[tuple[float, int]] = []

    def put(self, value):
        self.events.append((time.perf_counter(), int(value.numel())))

    def end(self):
        pass


class ForwardTimer:
    """(start, end) of every forward call of a module, via forward pre/post hooks."""

    def __init__(self, module, device):
        self.module, self.device, self.calls, self._t, self._hooks = module, device, [], 0.0, []

    def __enter__(self):
        if self.module is not None:
            self._hooks = [
                self.module.register_forward_pre_hook(self._pre),
                self.module.register_forward_hook(self._post),
            ]
        return self

    def _pre(self, *_):
        sync(self.device)
        self._t = time.perf_counter()

    def _post(self, *_):
        sync(self.device)
        self.calls.append((self._t, time.perf_counter()))

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
