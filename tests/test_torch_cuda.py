"""record() with CUDA tensors, where a CUDA device is present (skipped elsewhere): the
chunks come back exactly as the numpy arrays they were made from; record() returns while
the GPU is still computing them; the copy is ordered on the caller's current stream, so
overwriting a tensor on that stream after record() does not change what was recorded; the
host copy is pinned and fenced by an event.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest
from test_remote_basic import assert_same
from test_torch_input import FIELDS, N, T, numpy_chunks, record_all

from recorder_client import RolloutRecorder
from recorder_client import _torch as torch_input

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

# GPU cycles a `torch.cuda._sleep` spins: a few hundred ms on current cards, so that the
# kernels queued behind it are surely still waiting when record() returns.
SPIN_CYCLES = 1_000_000_000


def on_gpu(traj: dict, states: dict) -> tuple[dict, dict]:
    """The same values as CUDA tensors laid out the awkward ways a training loop makes them."""
    cuda = torch.device("cuda")
    out_traj = {
        "action": torch.from_numpy(np.ascontiguousarray(traj["action"].T)).to(cuda).t(),
        "reward": torch.tensor(traj["reward"], device=cuda, requires_grad=True) * 1.0,
        "done": torch.from_numpy(traj["done"].copy()).to(cuda),
    }
    assert not out_traj["action"].is_contiguous() and out_traj["reward"].requires_grad
    negated = torch._neg_view(torch.from_numpy(-states["pos"]).to(cuda))
    assert negated.is_neg()
    out_states = {
        "pos": negated,
        "flags": torch.from_numpy(states["flags"].copy()).to(cuda),
        "grid": torch.from_numpy(np.repeat(states["grid"], 2, axis=-1)).to(cuda)[..., ::2],
        "half": torch.from_numpy(states["half"].copy()).to(cuda),
        "wide": torch.from_numpy(states["wide"].copy()).to(cuda).requires_grad_(True),
    }
    return out_traj, out_states


def test_cuda_tensors_record_exactly_what_numpy_does(target):
    host = numpy_chunks(3)
    ours = record_all(target, "cuda", [on_gpu(*chunk) for chunk in host])
    assert ours.lengths.sum() == 3 * T * N
    assert_same(ours, record_all(target, "numpy", host))


def test_cuda_flags_are_read_and_recorded_exactly(target):
    rng = np.random.default_rng(3)
    host = numpy_chunks(2)
    for traj, _ in host:
        done = traj.pop("done")
        cut = rng.random(done.shape) < 0.5
        traj["terminated"], traj["truncated"] = done & ~cut, done & cut
    gpu = [
        ({k: torch.from_numpy(v.copy()).cuda() for k, v in traj.items()}, states)
        for traj, states in host
    ]
    with RolloutRecorder(target=target, session="cuda-flags") as rec:
        for traj, _ in gpu:
            assert rec.record(traj)
        ours = rec.finish()
    terminated = np.concatenate([traj["terminated"] for traj, _ in host])
    truncated = np.concatenate([traj["truncated"] for traj, _ in host])
    for b in range(ours.num_episodes):
        e, s, n = int(ours.episode_env[b]), int(ours.episode_start[b]), int(ours.lengths[b])
        assert ours.episode_terminated[b] == terminated[s + n - 1, e]
        assert ours.episode_truncated[b] == truncated[s + n - 1, e]
    assert int(ours.episode_terminated.sum()) == int(terminated.sum())
    assert int(ours.episode_truncated.sum()) == int(truncated.sum())


def computed_after(chunk: tuple[dict, dict]) -> tuple[Callable[[], None], tuple[dict, dict]]:
    """Tensors for the chunk's values, allocated now, and the kernels that fill them, to be
    queued behind a spin (record() must not wait for them). Allocating after the spin may
    wait for it (a clone behind a 0.5 s spin returned after it on an H200)."""
    traj, states = chunk
    out = (
        {k: torch.empty_like(v) for k, v in traj.items()},
        {k: torch.empty_like(v) for k, v in states.items()},
    )

    def fill() -> None:
        with torch.no_grad():
            for made, source in zip(out, chunk):
                for k, v in source.items():
                    made[k].copy_(v)

    return fill, out


def test_record_returns_while_the_gpu_still_computes_the_chunk(target):
    host = numpy_chunks(2)
    gpu = [on_gpu(*chunk) for chunk in host]
    stream = torch.cuda.current_stream()
    with RolloutRecorder(
        record_states=True, state_fields=FIELDS, target=target, session="cuda-async"
    ) as rec:
        assert rec.record(*gpu[0])  # the first call sets the session up
        rec.flush()
        fill, chunk = computed_after(gpu[1])
        fill()  # CUDA loads a kernel at its first launch, and that may wait for the device
        torch.cuda.synchronize()
        torch.cuda._sleep(SPIN_CYCLES)
        fill()
        t0 = time.perf_counter()
        assert rec.record(*chunk)
        took = time.perf_counter() - t0
        still_busy = not stream.query()
        out = rec.finish()
    assert still_busy, f"record() waited for the GPU ({took * 1e3:.1f} ms)"
    assert_same(out, record_all(target, "cuda-async-numpy", host))


def test_overwriting_on_the_same_stream_after_record_keeps_what_was_recorded(target):
    traj, states = numpy_chunks(1)[0]
    with RolloutRecorder(
        record_states=True, state_fields=FIELDS, target=target, session="cuda-reuse"
    ) as rec:
        gpu_traj, gpu_states = on_gpu(traj, states)
        torch.cuda._sleep(SPIN_CYCLES)  # the copy waits behind this, the overwrite behind it
        assert rec.record(gpu_traj, gpu_states)
        with torch.no_grad():
            for tensor in (*gpu_traj.values(), *gpu_states.values()):
                if not tensor.is_neg():
                    tensor.fill_(1)
        out = rec.finish()
    assert_same(out, record_all(target, "cuda-reuse-numpy", [(traj, states)]))


def test_a_chunk_computed_on_a_side_stream_is_copied_on_it(target):
    traj, states = numpy_chunks(1)[0]
    fill, chunk = computed_after(on_gpu(traj, states))
    fill()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with RolloutRecorder(
        record_states=True, state_fields=FIELDS, target=target, session="cuda-side"
    ) as rec:
        with torch.cuda.stream(side):
            torch.cuda._sleep(SPIN_CYCLES)
            fill()
            assert rec.record(*chunk)
        out = rec.finish()
    assert_same(out, record_all(target, "cuda-side-numpy", [(traj, states)]))


def test_the_host_copy_is_pinned_and_waits_on_its_event():
    source = torch.arange(24, dtype=torch.float32, device="cuda").reshape(4, 6).t()
    np.asarray(torch_input.start_host_copy(source))  # pinned memory allocated once
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN_CYCLES)
    source = source.clone()
    copy = torch_input.start_host_copy(source)
    assert copy._host.is_pinned()
    assert not copy._ready.query()  # the copy is queued behind the spin, not done
    assert (copy.shape, copy.dtype, copy.nbytes) == ((6, 4), np.dtype("float32"), 96)
    assert np.array_equal(np.asarray(copy), np.arange(24, dtype=np.float32).reshape(4, 6).T)
    assert copy._ready is None  # waited on once, then forgotten


def test_the_copies_of_one_call_share_one_event():
    tensors = [torch.full((4, 3), i, device="cuda") for i in range(3)]
    copies = [torch_input.take(t, "trajectories.x") for t in tensors]  # deferred
    assert all(isinstance(c._ready, torch_input._Unfenced) for c in copies)
    torch_input.fence_copies()
    assert torch_input.STARTED.copies is None
    events = {id(c._ready) for c in copies}
    assert len(events) == 1 and isinstance(copies[0]._ready, torch.cuda.Event)
    assert [np.asarray(c).tolist() for c in copies] == [[[i] * 3] * 4 for i in range(3)]
