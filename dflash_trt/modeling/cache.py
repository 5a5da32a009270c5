"""KV cache with per-row lengths, shared by the target and the drafter.

Layout (contiguous): per layer K and V of shape [R, H_kv, S_max, D]; the slot of a token is its
absolute position. Invariant: for row r, slots < lengths[r] hold valid entries and slots at or
beyond it are scratch. A forward writes its n new tokens at positions lengths[r] .. +n-1 before
attending, and attention masks by position, so cropping a row (rewind after rejected drafts)
is only `lengths[r] = new_length`; stale slots are overwritten before they can be seen.
"""

from __future__ import annotations

import torch

from dflash_trt.errors import DFlashError


class KVCache:
    def __init__(
        self,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        self.max_len = max_len
        self._allocate(num_layers, (batch, num_kv_heads, max_len, head_dim), dtype, device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)  # [R] valid slots per row

    def _allocate(self, num_layers: int, shape: tuple, dtype: torch.dtype, device) -> None:
        """Zeroed K and V of `shape` [R, H_kv, S_max, D] per layer; fast_path.StackedKVCache stacks them."""
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    def room(self) -> int:
        """Positions left after the longest row: a write of n positions at every row's length fits when
        n <= room() (rows are written to the same width, so the longest row bounds the batch)."""
        return self.max_len - int(self.lengths.max())

    def check_room(self, n: int) -> None:
        if self.lengths.is_cuda and torch.cuda.is_current_stream_capturing():
            return  # a host sync cannot be captured; modeling/cuda_graph.py checks before each replay
        if n > self.room():
            raise DFlashError(
                f"KV cache full: {self.max_len - self.room() + n} positions needed, max_len={self.max_len}; "
                f"raise max_seq_len or shorten the prompt / max_new_tokens"
            )

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Store k, v [R, H_kv, n, D] at slots positions [R, n] (absolute positions)."""
        idx = positions[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        self.k[layer].scatter_(2, idx, k.to(self.k[layer].dtype))
        self.v[layer].scatter_(2, idx, v.to(self.v[layer].dtype))

    def write_run(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """write() for one row (R == 1): k, v [1, H_kv, n, D] at slots start .. start + n - 1, a slice copy."""
        n = k.shape[2]
        self.k[layer][:, :, start : start + n].copy_(k)
        self.v[layer][:, :, start : start + n].copy_(v)

    def view(self, layer: int, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of all rows for slots [0, upto): [R, H_kv, upto, D]."""
        return self.k[layer][:, :, :upto], self.v[layer][:, :, :upto]

    def gather_slots(self, src: torch.Tensor, start: torch.Tensor) -> None:
        """Move, in every layer, the K/V at slots src [R, m] to slots start[r] + 0..m-1 (start [R]);
        lengths stay. A tree verify (decoding/tree.py) keeps its winning branch this way: the branch's
        nodes, spread over the tree's slots, become the contiguous run a chain verify would have written.
        All sources are read before any slot is written, so the runs may overlap."""
        R, m = src.shape
        dst = start[:, None] + torch.arange(m, device=src.device)  # [R, m]
        for kv in (self.k, self.v):
            for t in kv:
                H, D = t.shape[1], t.shape[3]
                moved = t.gather(2, src[:, None, :, None].expand(-1, H, -1, D))  # [R, H_kv, m, D]
                t.scatter_(2, dst[:, None, :, None].expand(-1, H, -1, D), moved)

    def crop(self, lengths: torch.Tensor) -> None:
        """Rewind every row to lengths [R] (must not exceed what was written)."""
        self.lengths = lengths.to(self.lengths)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only the given rows (a finished request leaves the batch)."""
        self.k = [t[rows] for t in self.k]
        self.v = [t[rows] for t in self.v]
        self.lengths = self.lengths[rows]

    def extend(self, other: KVCache) -> None:
        """Append other's rows (requests joining the batch). Both caches must share max_len."""
        if other.max_len != self.max_len or len(other.k) != len(self.k):
            raise ValueError(f"cannot join caches of max_len {other.max_len} and {self.max_len}")
        self.k = [torch.cat([a, b]) for a, b in zip(self.k, other.k)]
        self.v = [torch.cat([a, b]) for a, b in zip(self.v, other.v)]
        self.lengths = torch.cat([self.lengths, other.lengths])
