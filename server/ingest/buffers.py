"""Decode buffers, reused: a chunk's arrays are decoded into buffers of the shapes in use.

With a trajectory store the ingest path decodes every chunk's arrays, keys them into its
window and gives the buffers back at once; fresh buffers for every chunk would each be
faulted in page by page.
"""

from __future__ import annotations

import sys
import threading

import numpy as np


class BufferPool:
    """Free decode buffers by (dtype, shape), up to ``max_bytes`` in all; a shape no take has
    asked for in ``stale_takes`` takes is dropped first when the pool is full."""

    def __init__(self, max_bytes: int = 128 << 20, stale_takes: int = 256) -> None:
        self.max_bytes = max_bytes
        # A shape no take asked for in this many takes is taken to be no longer sent.
        self.stale_takes = stale_takes
        self._free: dict[tuple[str, tuple[int, ...]], list[np.ndarray]] = {}
        self._bytes = 0
        self._takes = 0
        self._last_take: dict[tuple[str, tuple[int, ...]], int] = {}
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Bytes of the free buffers held."""
        return self._bytes

    def free_count(self, shape: tuple[int, ...], dtype: np.dtype) -> int:
        """Free buffers of this shape and dtype."""
        with self._lock:
            return len(self._free.get((np.dtype(dtype).str, tuple(shape)), ()))

    def take(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        key = (np.dtype(dtype).str, tuple(shape))
        with self._lock:
            self._takes += 1
            self._last_take[key] = self._takes
            free = self._free.get(key)
            if free:
                arr = free.pop()
                self._bytes -= arr.nbytes
                return arr
        return np.empty(shape, dtype=dtype)

    def give_all(self, arrays: dict[str, np.ndarray]) -> None:
        """Take every array out of ``arrays`` and keep those nothing else refers to."""
        while arrays:
            _, arr = arrays.popitem()
            # 2: this name and getrefcount's argument (a view or another holder adds more).
            if arr.base is not None or sys.getrefcount(arr) != 2 or not arr.flags.writeable:
                continue
            key = (arr.dtype.str, arr.shape)
            with self._lock:
                if self._bytes + arr.nbytes > self.max_bytes:
                    # Full: stale shapes go; warm buffers of the shapes in use stay for
                    # the next chunks (releases come in bursts), and this one goes.
                    self._drop_stale()
                    if self._bytes + arr.nbytes > self.max_bytes:
                        continue
                self._free.setdefault(key, []).append(arr)
                self._bytes += arr.nbytes

    def _drop_stale(self) -> None:
        oldest = self._takes - self.stale_takes
        for key in [k for k in self._free if self._last_take.get(k, 0) <= oldest]:
            self._bytes -= sum(a.nbytes for a in self._free.pop(key))
        for key in [k for k, t in self._last_take.items() if t <= oldest]:
            del self._last_take[key]
