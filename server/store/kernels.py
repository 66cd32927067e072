"""Compiled loops for the store's per-step work (numba; the GIL is released while they run).

Each loop replaces a chain of numpy passes over every step of a batch with one pass, and adds
floats in exactly the order the one-episode-at-a-time rules do, so results stay bit-identical
to recording episodes one by one. numba is imported, and the loops compiled (or loaded from
its on-disk cache), only once a store exists: :func:`warm_up` does it in the background so
that the first chunk does not wait. A compile (tens of seconds, once per install) runs in a
child process, so that it never holds this process's GIL while the server answers calls.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading

import numpy as np

from ..errors import ErrorKind, RequestError
from ..extras import available, missing_message

logger = logging.getLogger(__name__)

_warm_lock = threading.Lock()
_warm_thread: threading.Thread | None = None
_warm_failed = False


def __getattr__(name: str):
    thread = _warm_thread
    if thread is not None and thread is not threading.current_thread():
        thread.join()  # loops in use before the warm-up is done: wait for it, not compile
    from . import _jit

    try:
        loop = getattr(_jit, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    if thread is not None and not thread.is_alive():
        globals()[name] = loop  # warmed up: later lookups skip this function
    return loop


def require() -> None:
    """Raise a NO_STORE `RequestError` naming the pip line when numba is not installed (a
    plain ``pip install rollout-recorder``): a session cannot have a store then."""
    if not available("numba"):
        raise RequestError(
            ErrorKind.NO_STORE,
            "capture: " + missing_message("numba", "a trajectory store on the server"),
        )


def warm_up(wait: bool = False, timeout: float | None = None) -> bool:
    """Compile (or load) every loop for the array types the store and the feeder pass, once
    per process, in a daemon thread. ``wait``: block until done or ``timeout`` seconds
    passed; returns whether the loops are ready. Raises as `require` does without numba."""
    global _warm_thread
    if _warm_thread is None:
        require()
    with _warm_lock:
        if _warm_thread is None:
            _warm_thread = threading.Thread(target=_compile_all, name="store-jit", daemon=True)
            _warm_thread.start()
        thread = _warm_thread
    if wait:
        thread.join(timeout)
    return not thread.is_alive() and not _warm_failed


def _compile_all() -> None:
    global _warm_failed
    try:
        # Fills numba's disk cache (a no-op but for its start-up when it is filled already).
        done = subprocess.run(
            [sys.executable, "-m", __package__], capture_output=True, text=True, timeout=1800
        )
        if done.returncode:
            logger.warning(
                "trajectory store: compiling the loops in a child failed: %s", done.stderr[-2000:]
            )
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("trajectory store: could not compile the loops in a child (%s)", exc)
    if not _load_all():
        _warm_failed = True


def _load_all() -> bool:
    """Compile, or load from the disk cache, every loop for the types in use; False on error."""
    try:
        from . import _jit

        i64, f64 = np.zeros(2, np.int64), np.zeros(2, np.float64)
        keys = np.zeros((2, 2), np.int64)
        lows, _ = _jit.key_bounds(keys)
        _jit.dense_codes(keys, lows, np.ones(2, np.int64), 1)
        offsets = np.array([0, 2], np.int64)
        _jit.segment_cumsum(f64.copy(), offsets)
        for reward_type in (np.float32, np.float64):
            _jit.chunk_cumsum(np.zeros((2, 2), reward_type), np.zeros((3, 2)))
        pairs = _jit.group_pairs(i64, f64, offsets, 1)
        _jit.discounted_pair_sums(i64, offsets, pairs[5], pairs[1], np.ones(2), 1)
        one = np.zeros(1, np.int64)
        _jit.add_pair_sums(np.zeros((1, 1))[0], one, one, one, f64[:1], f64[:1])
        _jit.replace_in_order(one, one, one, f64[:1], one - 1, one.copy(), f64[:1].copy(), 0)
        env, start, lengths = np.zeros(1, np.int64), np.zeros(1, np.int64), np.ones(1, np.int64)
        for key_type in (np.int16, np.int32, np.int64):
            keys = np.zeros((2, 1, 2), key_type)
            lows, _ = _jit.window_bounds(keys, env, start, lengths, 2)
            for reward_type in (np.float32, np.float64):
                _jit.window_pairs(
                    keys,
                    np.zeros((1, 2), reward_type),
                    2,
                    env,
                    start,
                    offsets[:2] // 2,
                    lows,
                    np.ones(2, np.int64),
                    1,
                    np.ones((1, 2)),
                )
        for ring_type, out_type in (
            (np.int16, np.int64),
            (np.int32, np.int64),
            (np.int64, np.int64),
            (np.float32, np.float32),
            (np.float64, np.float64),
            (np.bool_, np.bool_),
        ):
            ring = np.zeros((2, 1, 2), ring_type)
            _jit.gather_ring(ring[:1], env, start, lengths, 2, np.zeros((1, 1), out_type))
            _jit.gather_ring(ring, env, start, lengths, 2, np.zeros((2, 1), out_type))
    except Exception:  # compiled on first real use instead; the error shows there
        logger.exception("trajectory store: compiling the store loops failed")
        return False
    return True
