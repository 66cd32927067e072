"""record() with device arrays (JAX-like): a host copy is started for an accelerator's arrays
only; arrays on CPU devices are read in place. Either way the session holds the same data."""

from __future__ import annotations

import numpy as np
import pytest
from test_remote_basic import assert_same

from recorder_client import RolloutRecorder, Trajectory

FIELDS = ("player_positions", "player_inventory")


class FakeDevice:
    def __init__(self, platform: str) -> None:
        self.platform = platform


class FakeSharding:
    def __init__(self, platform: str) -> None:
        self.device_set = {FakeDevice(platform)}


class FakeDeviceArray:
    """What the client uses of a jax.Array: shape, dtype, nbytes, sharding, the async host
    copy, and the conversion to numpy."""

    def __init__(self, data: np.ndarray, platform: str) -> None:
        self._data = data
        self.sharding = FakeSharding(platform)
        self.copies_started = 0

    shape = property(lambda self: self._data.shape)
    dtype = property(lambda self: self._data.dtype)
    nbytes = property(lambda self: self._data.nbytes)

    def copy_to_host_async(self) -> None:
        self.copies_started += 1

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return self._data if dtype is None else self._data.astype(dtype)


def make_chunk(seed: int, T: int = 8, N: int = 4) -> tuple[dict, dict]:
    rng = np.random.default_rng(seed)
    traj = {
        "action": rng.integers(0, 12, (T, N)).astype(np.int32),
        "reward": rng.standard_normal((T, N)).astype(np.float32),
        "done": rng.random((T, N)) < 0.2,
    }
    states = {
        "player_positions": rng.integers(0, 64, (T, N, 1, 2)).astype(np.int32),
        "player_inventory": rng.integers(0, 9, (T, N, 1, 16)).astype(np.int32),
    }
    return traj, states


def record_all(target: str, session: str, chunks: list[tuple[dict, dict]]) -> Trajectory:
    with RolloutRecorder(
        record_states=True, state_fields=list(FIELDS), target=target, session=session
    ) as rec:
        for traj, states in chunks:
            assert rec.record(traj, states)
        return rec.finish()


@pytest.mark.parametrize("platform, copies", [("gpu", 1), ("tpu", 1), ("cpu", 0)])
def test_host_copy_started_for_accelerator_arrays_only(target, platform, copies):
    host = [make_chunk(seed) for seed in range(3)]
    device = [
        tuple({k: FakeDeviceArray(v, platform) for k, v in d.items()} for d in chunk)
        for chunk in host
    ]
    ours = record_all(target, f"dev-{platform}", device)
    for traj, states in device:
        for array in (*traj.values(), *states.values()):
            assert array.copies_started == copies
    assert_same(ours, record_all(target, f"host-{platform}", host))


def test_jax_cpu_arrays_from_jit(target):
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")

    @jax.jit
    def rollout(chunk):
        traj, states = chunk
        return {k: jnp.asarray(v) for k, v in traj.items()}, {
            k: jnp.asarray(v) + 0 for k, v in states.items()
        }

    host = [make_chunk(seed) for seed in range(3)]
    device = [rollout(chunk) for chunk in host]
    assert_same(record_all(target, "jax", device), record_all(target, "numpy", host))


@pytest.mark.parametrize("platform, copies", [("gpu", 1), ("cpu", 0)])
def test_shared_sharding_and_varying_lengths(target, platform, copies):
    """A loop's arrays share their sharding, whose platform is looked up once: each GPU array
    still has its copy started, no CPU one does. Chunks of one layout but different T are
    sized without reading the arrays, and the bytes counted are theirs."""
    sharding = FakeSharding(platform)
    host = [make_chunk(seed, T=T) for seed, T in enumerate((8, 3, 8, 11, 1))]
    device = []
    for chunk in host:
        arrays = tuple({k: FakeDeviceArray(v, platform) for k, v in d.items()} for d in chunk)
        for d in arrays:
            for array in d.values():
                array.sharding = sharding
        device.append(arrays)
    with RolloutRecorder(
        record_states=True, state_fields=list(FIELDS), target=target, session=f"len-{platform}"
    ) as rec:
        for traj, states in device:
            assert rec.record(traj, states)
        rec.flush()
        assert rec.stats.raw_bytes == sum(
            a.nbytes for traj, states in host for a in (*traj.values(), *states.values())
        )
        ours = rec.finish()
    for traj, states in device:
        for array in (*traj.values(), *states.values()):
            assert array.copies_started == copies
    assert_same(ours, record_all(target, f"len-host-{platform}", host))
