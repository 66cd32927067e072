"""The synthetic environment's pixel frames (the bench's pixel rows, `frame_size=84`)."""

from __future__ import annotations

import numpy as np
import pytest

from recorder_server.workload import GRID, SyntheticVecEnv


def test_frames_leave_every_other_array_as_it_was() -> None:
    plain = SyntheticVecEnv(6, seed=3, done_prob=0.05)
    pixels = SyntheticVecEnv(6, seed=3, done_prob=0.05, frame_size=84)
    assert plain.state_fields == ["player_positions", "player_inventory"]
    assert pixels.state_fields == [*plain.state_fields, "frames"]
    for _ in range(3):
        (r0, s0), (r1, s1) = plain.collect(20), pixels.collect(20)
        assert s0.frames is None
        for name in ("action", "reward", "done"):
            np.testing.assert_array_equal(getattr(r0, name), getattr(r1, name))
        np.testing.assert_array_equal(s0.player_positions, s1.player_positions)
        np.testing.assert_array_equal(s0.player_inventory, s1.player_inventory)
        assert s1.frames.shape == (20, 6, 84, 84) and s1.frames.dtype == np.uint8


def test_frames_draw_the_player_and_the_inventory() -> None:
    env = SyntheticVecEnv(4, seed=1, done_prob=0.0, frame_size=84)
    for _ in range(5):  # inventories grow from zero
        _, states = env.collect(16)
    frames, pos, inv = states.frames, states.player_positions, states.player_inventory
    for t in (0, 15):
        for e in range(4):
            row, col = (int(v) * 84 // GRID for v in pos[t, e, 0])
            if row > 0:  # the top row is the inventory bar's
                assert frames[t, e, row, col] == 255
            width = min(int(inv[t, e].sum()), 84)
            assert (frames[t, e, 0, :width] == 200).all()
    again = SyntheticVecEnv(4, seed=1, done_prob=0.0, frame_size=84)
    for _ in range(5):
        _, repeat = again.collect(16)
    np.testing.assert_array_equal(repeat.frames, frames)


def test_a_frame_smaller_than_its_tiles_is_refused() -> None:
    with pytest.raises(ValueError, match="frame_size must be >= 7 pixels, got 4"):
        SyntheticVecEnv(2, frame_size=4)
