"""record() with torch tensors: CPU tensors of every numpy dtype (non-contiguous, requiring
grad, with a lazy negative bit) give back exactly the numpy chunks they were made from;
tensors numpy cannot hold are refused at record(), naming the field, what was expected and
what arrived; the client imports torch only when the caller did.

A CUDA tensor's pinned asynchronous copy and its event are in test_torch_cuda.py (run where a
GPU is present); their host side (start_host_copy on a CPU tensor, HostCopy waiting on its
event before the first read) is run below.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from test_remote_basic import assert_same

from recorder_client import InvalidChunkError, RolloutRecorder, Trajectory
from recorder_client import _torch as torch_input

torch = pytest.importorskip("torch")

FIELDS = ["pos", "flags", "grid", "half", "wide"]
T, N = 12, 5


def numpy_chunks(count: int) -> list[tuple[dict, dict]]:
    rng = np.random.default_rng(7)
    chunks = []
    for _ in range(count):
        traj = {
            "action": rng.integers(-3, 1 << 40, (T, N), dtype=np.int64),
            "reward": rng.standard_normal((T, N)).astype(np.float32),
            "done": rng.random((T, N)) < 0.25,
        }
        states = {
            "pos": rng.standard_normal((T, N, 3)).astype(np.float32),
            "flags": rng.random((T, N, 2)) < 0.5,
            "grid": rng.integers(0, 255, (T, N, 2, 2), dtype=np.uint8),
            "half": rng.standard_normal((T, N)).astype(np.float16),
            "wide": rng.standard_normal((T, N, 4)),
        }
        chunks.append((traj, states))
    return chunks


def as_tensors(traj: dict, states: dict) -> tuple[dict, dict]:
    """The same values as tensors laid out the awkward ways a training loop makes them."""
    out_traj = {
        # (N, T) storage transposed: a non-contiguous view.
        "action": torch.from_numpy(np.ascontiguousarray(traj["action"].T)).t(),
        # Part of an autograd graph.
        "reward": torch.tensor(traj["reward"], requires_grad=True) * 1.0,
        "done": torch.from_numpy(traj["done"].copy()),
    }
    assert not out_traj["action"].is_contiguous() and out_traj["reward"].requires_grad
    negated = torch._neg_view(torch.from_numpy(-states["pos"]))  # the lazy negative bit
    assert negated.is_neg()
    out_states = {
        "pos": negated,
        "flags": torch.from_numpy(states["flags"].copy()),
        # Every other element of a wider tensor: strided in its last dimension.
        "grid": torch.from_numpy(np.repeat(states["grid"], 2, axis=-1))[..., ::2],
        "half": torch.from_numpy(states["half"].copy()),
        "wide": torch.from_numpy(states["wide"].copy()).requires_grad_(True),
    }
    return out_traj, out_states


def record_all(target: str, session: str, chunks: list[tuple[dict, dict]]) -> Trajectory:
    with RolloutRecorder(
        record_states=True, state_fields=FIELDS, target=target, session=session
    ) as rec:
        for traj, states in chunks:
            assert rec.record(traj, states)
        return rec.finish()


def test_cpu_tensors_record_exactly_what_numpy_does(target):
    host = numpy_chunks(3)
    ours = record_all(target, "torch", [as_tensors(*chunk) for chunk in host])
    # The truth: each episode's steps read straight from the numpy chunks by its env and start.
    action = np.concatenate([traj["action"] for traj, _ in host])
    reward = np.concatenate([traj["reward"] for traj, _ in host])
    done = np.concatenate([traj["done"] for traj, _ in host])
    states = {k: np.concatenate([s[k] for _, s in host]) for k in FIELDS}
    # Every done ends an episode; an env whose last step is no done leaves an unfinished tail.
    assert ours.num_episodes == int(done.sum()) + int((~done[-1]).sum())
    for b in range(ours.num_episodes):
        e, s, n = int(ours.episode_env[b]), int(ours.episode_start[b]), int(ours.lengths[b])
        assert np.array_equal(ours.actions[b, :n], action[s : s + n, e])
        assert ours.rewards[b, :n].tobytes() == reward[s : s + n, e].tobytes()
        assert ours.episode_done[b] == done[s + n - 1, e]
        for k in FIELDS:
            got = ours.states[k][b, :n]
            assert got.dtype == states[k].dtype, k
            assert got.tobytes() == states[k][s : s + n, e].tobytes(), k
    assert ours.lengths.sum() == 3 * T * N
    assert_same(ours, record_all(target, "numpy", host))


def test_cpu_tensor_is_read_in_place():
    tensor = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    held = torch_input.take(tensor, "trajectories.action")  # read later, by the sender
    assert held is tensor and torch_input.dtype_of(held) == np.dtype("int32")
    assert np.shares_memory(torch_input.host_view(held), tensor.numpy())
    grad = torch.ones(3, requires_grad=True)  # the sender's view is detached from the graph
    assert torch_input.host_view(torch_input.take(grad, "trajectories.reward")).tolist() == [1] * 3
    now = torch_input.take(tensor, "trajectories.action", defer=False)
    assert isinstance(now, np.ndarray) and np.shares_memory(now, tensor.numpy())


def test_flag_tensors_are_checked_at_record(target):
    traj, _ = numpy_chunks(1)[0]
    terminated = torch.zeros((T, N), dtype=torch.bool)
    truncated = torch.zeros((T, N), dtype=torch.bool)
    truncated[4, 2] = True
    done = torch.zeros((T, N), dtype=torch.bool)  # says no at row 4, env 2
    chunk = {**traj, "done": done, "terminated": terminated, "truncated": truncated}
    with RolloutRecorder(target=target, session="torch-flags") as rec:
        with pytest.raises(
            InvalidChunkError, match=r"^trajectories.done: expected .* row 4, env 2"
        ):
            rec.record(chunk)
        valid = torch.ones((T, N), dtype=torch.bool)
        valid[6, 1] = False  # inside an open episode
        chunk = {**traj, "terminated": terminated, "truncated": truncated, "valid": valid}
        chunk.pop("done")
        with pytest.raises(InvalidChunkError, match=r"^trajectories.valid: expected True at row 6"):
            rec.record(chunk)
        outcome = torch.full((T, N), 7, dtype=torch.int32)
        with pytest.raises(InvalidChunkError, match=r"^trajectories.outcome: .* got 7"):
            rec.record({**traj, "outcome": outcome})
        assert rec.stats.chunks_sent == 0


@pytest.mark.parametrize(
    "make, field, got",
    [
        (lambda: torch.zeros((T, N), dtype=torch.bfloat16), "action", "torch.bfloat16 tensor"),
        (lambda: torch.zeros((T, N)).to_sparse(), "action", "torch.sparse_coo tensor"),
        (lambda: torch.zeros((T, N), device="meta"), "action", "on meta that cannot be copied"),
        # numpy holds it: the chunk's dtype check refuses it, under its own label.
        (lambda: torch.zeros((T, N), dtype=torch.complex64), "action", "got '<c8' (complex64)"),
        (lambda: torch.zeros((T, N, 2), dtype=torch.float8_e4m3fn), "pos", "float8_e4m3fn"),
    ],
)
def test_tensors_numpy_cannot_hold_are_refused_naming_the_field(target, make, field, got):
    traj, states = numpy_chunks(1)[0]
    label = f"trajectories.{field}" if field in traj else f"env_states.{field}"
    (traj if field in traj else states)[field] = make()
    with RolloutRecorder(
        record_states=True, state_fields=FIELDS, target=target, session="bad"
    ) as rec:
        with pytest.raises(InvalidChunkError) as info:
            rec.record(traj, states)
        message = str(info.value)
        assert message.startswith(label) or message.startswith(f"{field}: "), message
        assert "expected" in message and got in message, message
        assert rec.stats.chunks_sent == 0


def test_after_tensor_chunks_a_bad_tensor_is_still_refused(target):
    # Once plain CPU tensors went through, record() takes them on a fast path: what it does
    # not keep must still get the full check, with the field named.
    chunks = numpy_chunks(2)
    bad = {
        "bfloat16": torch.zeros((T, N), dtype=torch.bfloat16),
        "sparse_coo": torch.zeros((T, N)).to_sparse(),
        "nested": torch.nested.nested_tensor([torch.zeros(3), torch.zeros(4)]),
        "meta": torch.zeros((T, N), device="meta"),
    }
    with RolloutRecorder(
        record_states=True, state_fields=FIELDS, target=target, session="fast-bad"
    ) as rec:
        rec.record(*as_tensors(*chunks[0]))
        for got, tensor in bad.items():
            traj, states = as_tensors(*chunks[1])
            with pytest.raises(InvalidChunkError) as info:
                rec.record({**traj, "reward": tensor}, states)
            message = str(info.value)
            assert message.startswith("trajectories.reward: expected"), message
            assert got in message, message
        rec.record(*as_tensors(*chunks[1]))
        rec.flush()
        assert rec.stats.chunks_acked == 2


@pytest.mark.parametrize("field", ["action", "done", "pos"])
def test_with_flags_a_bad_tensor_after_good_ones_is_refused_before_it_is_read(target, field):
    # With terminated and truncated, record() reads the action's shape and the flags'
    # values before the layout check: a tensor kept on the fast path is checked first.
    chunks = numpy_chunks(2)

    def with_flags(traj: dict, states: dict) -> tuple[dict, dict]:
        traj, states = as_tensors(traj, states)
        done = traj["done"]
        return {**traj, "terminated": done, "truncated": torch.zeros_like(done)}, states

    bad = {
        "bfloat16": lambda like: like.to(torch.bfloat16),
        "nested": lambda like: torch.nested.nested_tensor([like[0], like[1]]),
    }
    with RolloutRecorder(
        record_states=True, state_fields=FIELDS, target=target, session=f"flags-bad-{field}"
    ) as rec:
        rec.record(*with_flags(*chunks[0]))
        for got, make in bad.items():
            traj, states = with_flags(*chunks[1])
            where, label = (states, "env_states") if field in states else (traj, "trajectories")
            where[field] = make(where[field].detach())
            with pytest.raises(InvalidChunkError) as info:
                rec.record(traj, states)
            message = str(info.value)
            assert message.startswith(f"{label}.{field}: expected a dense CPU"), message
            assert got in message, message
        rec.record(*with_flags(*chunks[1]))
        rec.flush()
        assert rec.stats.chunks_acked == 2


def test_an_object_that_is_no_array_is_refused_naming_the_field(target):
    traj, states = numpy_chunks(1)[0]
    traj["reward"] = [[1.0, 2.0], [3.0]]  # ragged
    with RolloutRecorder(target=target, session="ragged") as rec:
        with pytest.raises(InvalidChunkError, match=r"^trajectories.reward: expected a numpy"):
            rec.record(traj)


class Event:
    """A CUDA event's one method the host copy uses, and whether it was waited on."""

    def __init__(self) -> None:
        self.waits = 0

    def synchronize(self) -> None:
        self.waits += 1


def test_host_copy_waits_for_its_copy_before_the_first_read():
    source = torch.arange(24, dtype=torch.float32).reshape(4, 6).t()  # non-contiguous
    copy = torch_input.start_host_copy(source)  # a CPU tensor: plain copy, no event
    assert (copy.shape, copy.dtype, copy.nbytes) == ((6, 4), np.dtype("float32"), 96)
    assert np.array_equal(np.asarray(copy), source.numpy())
    assert not np.shares_memory(np.asarray(copy), source.numpy())

    event = Event()
    fenced = torch_input.HostCopy(torch.ones(3, dtype=torch.int64), event, np.dtype("int64"))
    assert event.waits == 0  # nothing waits at record()
    assert np.asarray(fenced).tolist() == [1, 1, 1] and event.waits == 1
    assert np.asarray(fenced, dtype=np.float32).dtype == np.float32 and event.waits == 1


def test_the_client_imports_torch_only_when_the_caller_did():
    code = (
        "import sys, numpy as np, recorder_client\n"
        "from recorder_client import _chunk\n"
        "_chunk.take(np.zeros(2), 'x'); _chunk.take([1, 2], 'x')\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
