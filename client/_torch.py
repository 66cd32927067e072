"""torch tensors as record() input, without importing torch.

A tensor can only exist once its caller imported torch, so this module finds torch in
``sys.modules`` and never imports it: the client's dependencies stay grpcio, protobuf, numpy
and zstandard.

- A CPU tensor is read in place by the sender thread: record() checks it through
  properties only (no call into torch) and keeps the tensor itself, and the sender takes
  ``numpy()``, a view of its memory (no copy unless a lazy conjugate or negative bit must
  be resolved). Where record() reads values (flags, masks, outcome codes) the view is
  taken at once.
- A CUDA tensor gets an asynchronous device-to-host copy into pinned memory on its device's
  current stream; record() records one event per device after its call's copies
  (``fence_copies``) and returns at once, and the sender thread waits on the event before it
  reads the bytes (the JAX path's ``copy_to_host_async``). Every call into CUDA costs the
  caller's thread (10-25 us each on a virtualised GPU machine), hence one event a call,
  not one a tensor.
- A tensor on another accelerator (mps, xpu, ...) is copied to the host before record()
  returns.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import numpy as np

from .errors import InvalidChunkError

# torch dtype -> numpy dtype, filled as dtypes are seen (None: numpy has no such dtype).
_NUMPY_DTYPES: dict[Any, np.dtype | None] = {}

_EXPECTED = "a dense CPU or CUDA tensor with a numpy dtype (bool, integer or floating)"

# (torch.Tensor, torch.strided) once a tensor was taken: record() keeps a tensor of that
# type, on the CPU and strided, after those two properties alone (before any was taken it
# sees no tensor type and takes the full path, which sets them). Its nesting and dtype are
# checked with the chunk's layout: the dtype the worker's last chunk had for that field (a
# nested tensor has no shape to compare), or check_kept() on it.
KEPT: tuple[Any, Any] = (None, None)


def _torch() -> Any:
    return sys.modules.get("torch")


def is_tensor(value: Any) -> bool:
    """Whether ``value`` is a torch tensor (False at once when torch was never imported)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def check_kept(tensor: Any, what: str) -> None:
    """What record() leaves unchecked of a CPU tensor it kept (see KEPT), and take() checks
    of every tensor: InvalidChunkError naming ``what`` for a nested tensor, or one of a
    dtype numpy does not hold."""
    if tensor.is_nested:
        raise _refuse(what, f"a nested tensor on {tensor.device}")
    if numpy_dtype(tensor.dtype) is None:
        raise _refuse(what, f"a {tensor.dtype} tensor on {tensor.device}")


def numpy_dtype(dtype: Any) -> np.dtype | None:
    """numpy's twin of a torch dtype, or None (bfloat16, the float8 types, quantized ...)."""
    try:
        return _NUMPY_DTYPES[dtype]
    except KeyError:
        pass
    try:
        found: np.dtype | None = _torch().empty(0, dtype=dtype).numpy().dtype
    except (TypeError, RuntimeError):
        found = None
    _NUMPY_DTYPES[dtype] = found
    return found


class HostCopy:
    """A tensor's host copy under way: shape, dtype and nbytes are known at once; reading it
    (np.asarray) first waits until the copy is complete (``ready.synchronize()``)."""

    __slots__ = ("_host", "_ready", "dtype", "nbytes", "shape")

    def __init__(self, host: Any, ready: Any, dtype: np.dtype) -> None:
        self._host = host  # the pinned host tensor the copy writes
        self._ready = ready  # an event recorded after the copy (or _Unfenced), or None
        self.shape = tuple(host.shape)
        self.dtype = dtype
        self.nbytes = host.numel() * dtype.itemsize

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        if self._ready is not None:
            self._ready.synchronize()
            self._ready = None
        array = self._host.numpy()
        return array if dtype is None else array.astype(dtype)

    def __repr__(self) -> str:
        return f"HostCopy(shape={self.shape}, dtype={self.dtype})"


class _Unfenced:
    """Stands for the event of a copy that fence_copies() has not fenced yet: waiting on it
    waits for the whole device (never reached by a chunk record() queued, which fences
    first)."""

    __slots__ = ("device",)

    def __init__(self, device: Any) -> None:
        self.device = device

    def synchronize(self) -> None:
        _torch().cuda.synchronize(self.device)


class _Started(threading.local):
    """The CUDA copies this thread's record() call started and has not fenced yet."""

    copies: list[tuple[HostCopy, Any]] | None = None


STARTED = _Started()


def fence_copies() -> None:
    """Record one event per device, on its current stream, after the CUDA copies this
    thread started since the last call (record() calls this once its arrays are taken)."""
    copies, STARTED.copies = STARTED.copies, None
    if not copies:
        return
    torch = _torch()
    events: dict[Any, Any] = {}
    for copy, device in copies:
        event = events.get(device)
        if event is None:
            event = events[device] = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
        copy._ready = event


def host_view(tensor: Any) -> np.ndarray:
    """A CPU tensor's memory as a numpy array: a view, detached from the autograd graph,
    copied only where a lazy conjugate or negative bit must be resolved. torch's methods
    release the GIL, so record() calls this only for the values it checks (flags, masks,
    outcome codes); the sender thread reads every other tensor through it."""
    if not tensor.requires_grad:
        try:
            # Not numpy(force=True) for every tensor: that first detaches it and moves it
            # through torch's dispatcher, and with those calls in the sender thread about
            # twice as many record() calls beside it were slow (bench `latency_torch`).
            return tensor.numpy()
        except RuntimeError:  # a lazy conjugate or negative bit
            pass
    return tensor.numpy(force=True)


def dtype_of(value: Any) -> np.dtype:
    """numpy's dtype of a host array or of a tensor that take() accepted."""
    dtype = value.dtype
    if isinstance(dtype, np.dtype):
        return dtype
    found = _NUMPY_DTYPES.get(dtype)
    return found if found is not None else np.dtype(dtype)


def start_host_copy(tensor: Any, fence: bool = True) -> HostCopy:
    """Start copying ``tensor`` into fresh host memory: pinned and asynchronous on its
    device's current stream for a CUDA tensor, fenced by an event at once (``fence``) or by
    the next fence_copies() on this thread; a plain synchronous copy for any other device.
    ``tensor`` has no lazy conjugate or negative bit (take() resolves them on the device)."""
    torch = _torch()
    cuda = tensor.is_cuda
    host = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, pin_memory=cuda)
    if not cuda:
        host.copy_(tensor)
        return HostCopy(host, None, numpy_dtype(tensor.dtype))
    host.copy_(tensor, non_blocking=True)
    copy = HostCopy(host, _Unfenced(tensor.device), numpy_dtype(tensor.dtype))
    if STARTED.copies is None:
        STARTED.copies = []
    STARTED.copies.append((copy, tensor.device))
    if fence:
        fence_copies()
    return copy


_CUDA: list[bool] = []  # torch.cuda.is_available(), asked once


def _cuda_available(torch: Any) -> bool:
    if not _CUDA:
        _CUDA.append(bool(torch.cuda.is_available()))
    return _CUDA[0]


def _refuse(what: str, got: str) -> InvalidChunkError:
    return InvalidChunkError(f"{what}: expected {_EXPECTED}, got {got}")


def take(tensor: Any, what: str, defer: bool = True) -> Any:
    """A CPU tensor as it is (``defer``: the sender reads it through host_view) or as a
    numpy view; a CUDA one as a HostCopy under way. InvalidChunkError naming ``what`` for a
    tensor numpy cannot hold or this process cannot copy."""
    global KEPT
    torch = _torch()
    KEPT = (torch.Tensor, torch.strided)
    # Properties only on the common path, no method of the tensor's: those release the GIL,
    # and taking it back from the sender thread cost record() up to 5 ms (bench
    # `latency_torch`: p99 from ~1.8 ms to tens of us). No wrapper object either: each
    # object a queued chunk holds counts towards the garbage collector's next collection,
    # and those collections landed in record() calls (the bench's p99).
    if tensor.layout is not torch.strided and not tensor.is_nested:
        raise _refuse(what, f"a {tensor.layout} tensor on {tensor.device}")
    check_kept(tensor, what)  # nested (a jagged one's layout is not strided) or its dtype
    if tensor.is_cpu:
        if defer:
            return tensor
        return host_view(tensor)
    # On the device: a host copy_ from a lazy negative view negates the pinned memory on the
    # CPU at once, before an asynchronous copy has landed (test_torch_cuda caught it).
    tensor = tensor.detach().resolve_conj().resolve_neg()
    if tensor.is_cuda and not _cuda_available(torch):
        raise _refuse(what, f"a tensor on {tensor.device}, and CUDA is not available here")
    try:
        return start_host_copy(tensor, fence=not defer)
    except (RuntimeError, TypeError) as exc:  # a meta tensor's copy, too (a RuntimeError)
        got = f"a tensor on {tensor.device} that cannot be copied to the host ({exc})"
        raise _refuse(what, got) from None
