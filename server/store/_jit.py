"""The compiled loops behind :mod:`.kernels` (imported on first use: numba takes a while)."""

from __future__ import annotations

import os
import tempfile

import numpy as np

# numba caches compiled code beside this file; where that is read-only (an installed image
# run as another user), it goes to the temp directory instead of failing.
if "NUMBA_CACHE_DIR" not in os.environ and not os.access(os.path.dirname(__file__), os.W_OK):
    os.environ["NUMBA_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), "rollout-recorder-numba")

from numba import njit  # noqa: E402


@njit(cache=True, nogil=True)
def segment_cumsum(values, offsets):  # pragma: no cover - compiled
    """In place: running sums of float64 ``values`` restarting at every offset (each segment
    as ``np.add.accumulate``: sequential, first element unchanged)."""
    for e in range(offsets.shape[0] - 1):
        a, b = offsets[e], offsets[e + 1]
        if b > a:
            s = values[a]
            for t in range(a + 1, b):
                s = s + values[t]
                values[t] = s
    return values


@njit(cache=True, nogil=True)
def group_pairs(step_codes, cumulative, offsets, num_codes):  # pragma: no cover - compiled
    """The (episode, cell) pairs of a batch, ordered by episode then code, each with its best
    step (highest cumulative reward, earliest on a tie); and each code's first step.

    Returns ``(pair_ep, pair_code, best_index, best_return, first_step, episode_pairs)``:
    best_index and first_step are indexes into the concatenation (first_step is
    ``len(step_codes)`` for codes no step has); episode e owns pairs
    episode_pairs[e]..episode_pairs[e+1]-1."""
    num_eps = offsets.shape[0] - 1
    num_steps = step_codes.shape[0]
    slot = np.empty(num_codes, np.int64)
    slot_ep = np.full(num_codes, -1, np.int64)
    first = np.full(num_codes, num_steps, np.int64)
    pair_ep = np.empty(num_steps, np.int64)
    pair_code = np.empty(num_steps, np.int64)
    best_index = np.empty(num_steps, np.int64)
    best_return = np.empty(num_steps, np.float64)
    episode_pairs = np.empty(num_eps + 1, np.int64)
    p = 0
    for e in range(num_eps):
        lo = p
        episode_pairs[e] = lo
        for t in range(offsets[e], offsets[e + 1]):
            c = step_codes[t]
            if slot_ep[c] != e:
                slot_ep[c] = e
                slot[c] = p
                pair_ep[p] = e
                pair_code[p] = c
                best_index[p] = t
                best_return[p] = cumulative[t]
                if first[c] == num_steps:
                    first[c] = t
                p += 1
            else:
                q = slot[c]
                if cumulative[t] > best_return[q]:
                    best_return[q] = cumulative[t]
                    best_index[q] = t
        if p - lo > 1:
            order = np.argsort(pair_code[lo:p]) + lo
            pair_code[lo:p] = pair_code[order]
            best_index[lo:p] = best_index[order]
            best_return[lo:p] = best_return[order]
    episode_pairs[num_eps] = p
    return (
        pair_ep[:p].copy(),
        pair_code[:p].copy(),
        best_index[:p].copy(),
        best_return[:p].copy(),
        first,
        episode_pairs,
    )


@njit(cache=True, nogil=True)
def discounted_pair_sums(
    step_codes, offsets, episode_pairs, pair_code, powers, num_codes
):  # pragma: no cover - compiled
    """Per pair, the sum of ``powers[k]`` over its steps, ``k`` = steps before the episode's
    last step; each sum accumulated from 0.0 in step order."""
    slot = np.empty(num_codes, np.int64)
    sums = np.zeros(pair_code.shape[0], np.float64)
    for e in range(offsets.shape[0] - 1):
        for p in range(episode_pairs[e], episode_pairs[e + 1]):
            slot[pair_code[p]] = p
        last = offsets[e + 1] - 1
        for t in range(offsets[e], offsets[e + 1]):
            q = slot[step_codes[t]]
            sums[q] = sums[q] + powers[last - t]
    return sums


@njit(cache=True, nogil=True)
def replace_in_order(
    pair_ep, pair_cell, pair_step, pair_return, best_traj, best_step, best_return, first_tid
):  # pragma: no cover - compiled
    """Best-reference replacement, pair after pair in (episode, cell) order, on copies of the
    batch cells' incumbents (updated in place): a pair takes its cell when the cell has no
    reference, or on a higher return, or an equal return at an earlier step.

    Returns ``(improved per episode, won (P,) bool, released tid per won pair or -1)``."""
    num_pairs = pair_ep.shape[0]
    num_eps = 0 if num_pairs == 0 else pair_ep[num_pairs - 1] + 1
    improved = np.zeros(num_eps, np.int64)
    won = np.zeros(num_pairs, np.bool_)
    released = np.full(num_pairs, -1, np.int64)
    for p in range(num_pairs):
        c = pair_cell[p]
        r, s, old = pair_return[p], pair_step[p], best_traj[c]
        if old < 0 or r > best_return[c] or (r == best_return[c] and s < best_step[c]):
            won[p] = True
            released[p] = old
            improved[pair_ep[p]] += 1
            best_traj[c] = first_tid + pair_ep[p]
            best_step[c] = s
            best_return[c] = r
    return improved, won, released


@njit(cache=True, nogil=True)
def gather_ring(ring, env, start, lengths, capacity, out):  # pragma: no cover - compiled
    """Copy episodes out of an env-major ring ``(rows, N, capacity)`` (time t of env e at
    ``[:, e, t % capacity]``) into ``out`` ``(rows, total)``, episode after episode."""
    for r in range(ring.shape[0]):
        dst = out[r]
        o = 0
        for i in range(env.shape[0]):
            row = ring[r, env[i]]
            n = lengths[i]
            a = start[i] % capacity
            head = min(n, capacity - a)  # the steps before the ring wraps
            dst[o : o + head] = row[a : a + head]  # slices: vectorised copies
            dst[o + head : o + n] = row[: n - head]
            o += n
    return out


@njit(cache=True, nogil=True)
def add_pair_sums(sums, cell_ids, pair_ep, pair_cell, pair_sums, sign):  # pragma: no cover
    """``sums[cell] += pair_sums[p] * sign[episode] + 0.0`` pair after pair (pairs of
    sign 0 skipped): the order one episode at a time adds them in."""
    for p in range(pair_ep.shape[0]):
        s = sign[pair_ep[p]]
        if s != 0.0:
            c = cell_ids[pair_cell[p]]
            sums[c] = sums[c] + (pair_sums[p] * s + 0.0)


@njit(cache=True, nogil=True)
def key_bounds(columns):  # pragma: no cover - compiled
    """Per row of the (F, S) key columns (S > 0), its minimum and maximum."""
    width = columns.shape[0]
    lows = np.empty(width, np.int64)
    highs = np.empty(width, np.int64)
    for j in range(width):
        lows[j], highs[j] = columns[j].min(), columns[j].max()  # vectorised reductions
    return lows, highs


@njit(cache=True, nogil=True)
def dense_codes(columns, lows, strides, num_codes):  # pragma: no cover - compiled
    """Mixed-radix code of every step, ``sum((key_j - low_j) * stride_j)``, and the number of
    steps with each code."""
    width, num_steps = columns.shape
    codes = np.zeros(num_steps, np.int64)
    for j in range(width):
        lo, stride = lows[j], strides[j]
        for t in range(num_steps):
            codes[t] += (columns[j, t] - lo) * stride
    counts = np.zeros(num_codes, np.int64)
    for t in range(num_steps):
        counts[codes[t]] += 1
    return codes, counts


@njit(cache=True, nogil=True)
def window_bounds(ring, env, start, lengths, capacity):  # pragma: no cover - compiled
    """Per row of an env-major ring (rows, N, capacity), the minimum and maximum over the
    episodes' steps (env[i], times start[i]..start[i]+lengths[i]-1); at least one step."""
    rows = ring.shape[0]
    lows = np.empty(rows, np.int64)
    highs = np.empty(rows, np.int64)
    for r in range(rows):
        lo = hi = np.int64(ring[r, env[0], start[0] % capacity])
        for i in range(env.shape[0]):
            row = ring[r, env[i]]
            a = start[i] % capacity
            head = min(lengths[i], capacity - a)
            # Slices (the run before the ring wraps, then the rest): vectorised reductions.
            for seg in (row[a : a + head], row[: lengths[i] - head]):
                if seg.size:
                    lo = min(lo, np.int64(seg.min()))
                    hi = max(hi, np.int64(seg.max()))
        lows[r], highs[r] = lo, hi
    return lows, highs


@njit(cache=True, nogil=True)
def window_pairs(
    ring, ring_rewards, capacity, env, start, offsets, lows, strides, num_codes, powers
):  # pragma: no cover - compiled
    """:func:`group_pairs` and :func:`discounted_pair_sums` in one pass over episodes read in
    place from an env-major ring (keys (rows, N, capacity), rewards (N, capacity)), coding
    each step's key as ``sum((key_j - lows_j) * strides_j)`` and summing the rewards into
    float64 cumulative returns on the way (as :func:`segment_cumsum`). Per episode, each
    cell's best step and sums are kept in per-code tables, added to step by step in order.

    Returns ``(pair_ep, pair_code, best_index, best_return, first_step, episode_pairs,
    counts, returns, bad, sums)``: counts per code, each episode's return (0.0 when empty),
    the index of the first step whose cumulative reward is not finite (-1: none), and the
    (U, P) discounted sums for each row of ``powers``."""
    num_eps = env.shape[0]
    num_steps = offsets[num_eps]
    rows = ring.shape[0]
    num_util = powers.shape[0]
    seen = np.full(num_codes, -1, np.int64)  # the last episode that visited each code
    code_index = np.empty(num_codes, np.int64)
    code_return = np.empty(num_codes, np.float64)
    code_sums = np.zeros((max(num_util, 1), num_codes), np.float64)
    touched = np.empty(min(num_codes, num_steps), np.int64)
    first = np.full(num_codes, num_steps, np.int64)
    counts = np.zeros(num_codes, np.int64)
    # Pairs: (episode, code, best index) and (best return, sums...), grown on demand: an
    # upper bound (the steps) would be a fresh, page-faulted allocation on every call.
    pair_cap = max(16, min(num_steps, num_eps * num_codes, 4096))
    pair_i = np.empty((3, pair_cap), np.int64)
    pair_f = np.empty((1 + num_util, pair_cap), np.float64)
    episode_pairs = np.empty(num_eps + 1, np.int64)
    returns = np.zeros(num_eps, np.float64)
    codes = np.empty(capacity, np.int64)
    cum = np.empty(capacity, np.float64)
    bad = -1
    p = 0
    for e in range(num_eps):
        episode_pairs[e] = p
        n = offsets[e + 1] - offsets[e]
        if n == 0:
            continue
        base = offsets[e]
        last = n - 1
        a = start[e] % capacity
        head = min(n, capacity - a)  # steps before the ring wraps
        if rows == 2:  # the usual two cell fields (positions): one pass
            r0, r1 = ring[0, env[e]], ring[1, env[e]]
            lo0, st0, lo1, st1 = lows[0], strides[0], lows[1], strides[1]
            for j in range(head):
                codes[j] = (np.int64(r0[a + j]) - lo0) * st0 + (np.int64(r1[a + j]) - lo1) * st1
            for j in range(head, n):
                k = j - head
                codes[j] = (np.int64(r0[k]) - lo0) * st0 + (np.int64(r1[k]) - lo1) * st1
        else:
            for j in range(n):
                codes[j] = 0
            for r in range(rows):
                row = ring[r, env[e]]
                lo, st = lows[r], strides[r]
                for j in range(head):
                    codes[j] += (np.int64(row[a + j]) - lo) * st
                for j in range(head, n):
                    codes[j] += (np.int64(row[j - head]) - lo) * st
        rew = ring_rewards[env[e]]
        s = 0.0
        for j in range(head):
            s = np.float64(rew[a + j]) if j == 0 else s + np.float64(rew[a + j])
            cum[j] = s
        for j in range(head, n):
            s = np.float64(rew[j - head]) if j == 0 else s + np.float64(rew[j - head])
            cum[j] = s
        nt = 0
        for j in range(n):
            code = codes[j]
            c = cum[j]
            if seen[code] != e:
                seen[code] = e
                touched[nt] = code
                nt += 1
                code_return[code] = c
                code_index[code] = base + j
                if first[code] == num_steps:
                    first[code] = base + j
                for u in range(num_util):
                    code_sums[u, code] = 0.0
            elif c > code_return[code]:  # strictly: the earliest step wins a tie
                code_return[code] = c
                code_index[code] = base + j
            counts[code] += 1
        for u in range(num_util):
            pw = powers[u]
            sums = code_sums[u]
            for j in range(n):
                sums[codes[j]] += pw[last - j]
        returns[e] = s
        if bad < 0 and not np.isfinite(s):
            for j in range(n):
                if not np.isfinite(cum[j]):
                    bad = base + j
                    break
        if p + nt > pair_cap:
            pair_cap = max(2 * pair_cap, p + nt)
            grown_i = np.empty((3, pair_cap), np.int64)
            grown_i[:, :p] = pair_i[:, :p]
            pair_i = grown_i
            grown_f = np.empty((1 + num_util, pair_cap), np.float64)
            grown_f[:, :p] = pair_f[:, :p]
            pair_f = grown_f
        # The episode's cells in code order, sorted in place (a few tens; np.sort would
        # allocate an array per episode, a fifth of the whole call).
        for i in range(1, nt):
            v = touched[i]
            k = i - 1
            while k >= 0 and touched[k] > v:
                touched[k + 1] = touched[k]
                k -= 1
            touched[k + 1] = v
        for q in range(nt):
            code = touched[q]
            pair_i[0, p] = e
            pair_i[1, p] = code
            pair_i[2, p] = code_index[code]
            pair_f[0, p] = code_return[code]
            for u in range(num_util):
                pair_f[1 + u, p] = code_sums[u, code]
            p += 1
    episode_pairs[num_eps] = p
    return (
        pair_i[0, :p].copy(),
        pair_i[1, :p].copy(),
        pair_i[2, :p].copy(),
        pair_f[0, :p].copy(),
        first,
        episode_pairs,
        counts,
        returns,
        bad,
        pair_f[1:, :p].copy(),
    )


@njit(cache=True, nogil=True)
def chunk_cumsum(rewards, out):  # pragma: no cover - compiled
    """Into ``out`` (T+1, N) float64: row 0 zeros, row k+1
    ``np.cumsum(rewards, axis=0, dtype=float64)[k]`` (the same additions, each column in
    time order)."""
    length, num_envs = rewards.shape
    out[0] = 0.0
    if length:
        for n in range(num_envs):
            out[1, n] = rewards[0, n]
        for t in range(1, length):
            for n in range(num_envs):
                out[t + 1, n] = out[t, n] + rewards[t, n]
    return out


# Explicit types: a C-contiguous source takes the strided ("A") version, so no layout or
# dtype the feeder passes ever compiles on the fly.
_RING_KEYS_TYPES = [
    f"UniTuple(int64, 2)({src}[:, :], int64, int64, {ring}[:, ::1], int64, int64)"
    for src in ("int32", "int64")
    for ring in ("int16", "int32", "int64")
]


@njit(_RING_KEYS_TYPES, cache=True, nogil=True)
def ring_keys(src, shift, bucket, ring, t0, capacity):  # pragma: no cover - compiled
    """A chunk's cell keys of one field into an env-major ring (N, capacity): step t of env n
    goes to ``ring[n, (t0 + t) % capacity]``, keyed ``src[t, n] >> shift`` (bucket 0: a power
    of two) or ``src[t, n] // bucket`` (floor, as numpy). Returns the keys' (min, max) as
    int64; a key the ring's dtype cannot hold is written truncated (the caller widens the
    ring and writes again)."""
    length, num_envs = src.shape
    lo = np.int64(0)
    hi = np.int64(0)
    if length == 0 or num_envs == 0:
        return lo, hi
    lo = np.int64(src[0, 0])
    lo = lo >> shift if bucket == 0 else lo // bucket
    hi = lo
    a = t0 % capacity
    head = min(length, capacity - a)
    # Env by env: the writes run along a ring row; the strided reads stay in cache.
    for n in range(num_envs):
        row = ring[n]
        for t in range(length):
            v = np.int64(src[t, n])
            k = v >> shift if bucket == 0 else v // bucket
            lo = min(lo, k)
            hi = max(hi, k)
            row[a + t if t < head else t - head] = k
    return lo, hi
