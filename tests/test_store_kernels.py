"""The compiled loops add floats exactly as the numpy code they replace (bit for bit)."""

import numpy as np
import pytest

from recorder_server.store import kernels


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float64).view(np.int64)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_chunk_cumsum_is_numpy_cumsum_over_time(dtype):
    rng = np.random.default_rng(0)
    rewards = rng.standard_normal((64, 9)).astype(dtype)
    rewards[0, :3] = -0.0  # kept as -0.0, as cumsum keeps a first element
    rewards[5, 4], rewards[7, 5] = np.inf, np.nan
    expected = np.concatenate([np.zeros((1, 9)), np.cumsum(rewards, axis=0, dtype=np.float64)])
    got = kernels.chunk_cumsum(rewards, np.full((65, 9), 7.0))
    np.testing.assert_array_equal(_bits(got), _bits(expected))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int32, np.bool_])
def test_the_feeders_cumsum_without_a_store_is_numpy_cumsum_over_time(dtype):
    from recorder_server.ingest.tails import cumsum

    rng = np.random.default_rng(1)
    rewards = (rng.standard_normal((64, 9)) * 100).astype(dtype)
    if rewards.dtype.kind == "f":
        rewards[0, :3] = -0.0
        rewards[5, 4], rewards[7, 5] = np.inf, np.nan
    expected = np.concatenate([np.zeros((1, 9)), np.cumsum(rewards, axis=0, dtype=np.float64)])
    got = cumsum(rewards)
    assert got.dtype == np.float64 and got.shape == (65, 9)
    np.testing.assert_array_equal(_bits(got), _bits(expected))


def test_segment_cumsum_is_numpy_cumsum_per_segment():
    rng = np.random.default_rng(1)
    lengths = np.array([0, 1, 7, 0, 30, 2], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    values = rng.standard_normal(int(offsets[-1])).astype(np.float32)
    values[offsets[2]] = -0.0
    expected = np.concatenate(
        [np.cumsum(values[a:b], dtype=np.float64) for a, b in zip(offsets[:-1], offsets[1:])]
    )
    got = kernels.segment_cumsum(values.astype(np.float64), offsets)
    np.testing.assert_array_equal(_bits(got), _bits(expected))


@pytest.mark.parametrize("src_type", [np.int32, np.int64])
@pytest.mark.parametrize("ring_type", [np.int16, np.int32, np.int64])
@pytest.mark.parametrize("bucket", [1, 2, 3, 4, 7])
def test_ring_keys_is_floor_division_into_the_ring(src_type, ring_type, bucket):
    """Keys as numpy's floor division (negative values included) at ring columns
    (t0 + t) % capacity, through a wrap; the bounds are the keys' min and max."""
    rng = np.random.default_rng(bucket)
    state = rng.integers(-1000, 1000, size=(12, 5, 1, 2)).astype(src_type)
    src = state[:, :, 0, 1]  # strided, as the feeder passes a field at an index
    capacity, t0 = 16, 29  # columns 13, 14, 15, 0, 1, ...
    ring = np.full((5, capacity), 99, ring_type)
    shift, div = (bucket.bit_length() - 1, 0) if bucket & (bucket - 1) == 0 else (0, bucket)
    low, high = kernels.ring_keys(src, shift, div, ring, t0, capacity)
    expected = np.floor_divide(src.astype(np.int64), bucket)
    columns = (t0 + np.arange(12)) % capacity
    np.testing.assert_array_equal(ring[:, columns], expected.T)
    untouched = np.setdiff1d(np.arange(capacity), columns)
    assert (ring[:, untouched] == 99).all()
    assert (low, high) == (expected.min(), expected.max())


def test_ring_keys_reports_keys_its_ring_cannot_hold():
    src = np.array([[40000], [-5]], np.int32)
    ring = np.zeros((1, 4), np.int16)
    assert kernels.ring_keys(src, 0, 0, ring, 0, 4) == (-5, 40000)


def test_warm_up_reports_ready():
    assert kernels.warm_up(wait=True, timeout=600)
