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


def test_warm_up_reports_ready():
    assert kernels.warm_up(wait=True, timeout=600)
