"""How far the dataset sink is behind: the age of the oldest finished episode not yet written.

The sink's thread looks at each session once a tick (at most a second): per worker, how many
episodes have finished and how many are written. `LagClock` remembers when each count of
finished episodes was first seen, so the first one not written has an age. An episode's age
starts when the sink first saw it, up to one tick after it finished. Memory is one entry per
tick in which a worker's count grew, until those episodes are written.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping


class LagClock:
    """The lag of one session's dataset; `observe` once per tick."""

    def __init__(self) -> None:
        # Worker id -> (time first seen, finished count then), counts increasing.
        self._seen: dict[str, deque[tuple[float, int]]] = {}

    def observe(self, now: float, finished: Mapping[str, int], written: Mapping[str, int]) -> float:
        """Seconds since the oldest finished episode not yet written was first seen (0.0 when
        every one is written). ``finished`` and ``written`` count episodes per worker."""
        lag = 0.0
        for worker in [w for w in self._seen if w not in finished]:
            del self._seen[worker]
        for worker, count in finished.items():
            seen = self._seen.setdefault(worker, deque())
            if seen and seen[-1][1] > count:
                seen.clear()  # the session was reset: counting starts again
            if count > (seen[-1][1] if seen else 0):
                seen.append((now, count))
            done = written.get(worker, 0)
            # Entries whose episodes are all written go; the first left holds the oldest
            # episode that is not.
            while seen and seen[0][1] <= done:
                seen.popleft()
            if seen:
                lag = max(lag, now - seen[0][0])
        return lag
