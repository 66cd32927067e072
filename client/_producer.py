"""One producer at a time per recorder: a Gymnasium wrapper or the SB3 callback.

A recorder splits episodes per environment index, at the flags it is given. Two producers
recording into one recorder at once would interleave their steps into the same envs'
episodes. A producer that takes over a recorder whose episodes another one left open (a
closed wrapper, an earlier callback whose env was reset since) would continue them with its
own first steps. Both are refused, naming what to do instead.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import numpy as np

from .errors import RecorderError

logger = logging.getLogger(__name__)


def own_recorder(kwargs: dict[str, Any]) -> Any:
    """The recorder a producer makes when given none: ``RolloutRecorder(**kwargs)``, its
    stream in a process of its own (``sender="process"``: the loop's thread keeps its speed,
    docs/concepts.md) unless ``kwargs`` pick a sender or ask for what only the thread sender
    does (``max_episodes``, ``on_error``, ``on_backpressure="drop"``)."""
    from .recorder import RolloutRecorder, threads_needed

    if "sender" not in kwargs and not threads_needed(kwargs):
        kwargs = {**kwargs, "sender": "process"}
    return RolloutRecorder(**kwargs)


def close_own(recorder: Any, name: str) -> None:
    """Close the recorder a producer made. Without a target it ran a private server, which
    ends with it: steps recorded since the last ``finish()`` would go unread, so say so."""
    if recorder._unread_private:
        logger.warning(
            "%s.close(): the recorder it made had no target, and its private server ends "
            "with it, taking the steps recorded since the last finish(). Give it a recorder "
            "(which stays open after close(), for finish()) or a target= to keep them.",
            name,
        )
    recorder.close()


class Claim:
    """A producer recording into a recorder, and what its last recorded step left."""

    __slots__ = ("closed", "name", "open_envs", "owner", "resume")

    def __init__(self, owner: Any, name: str) -> None:
        self.owner = weakref.ref(owner)
        self.name = name
        self.closed = False
        # Which envs' episodes the last recorded step left open (None: nothing recorded).
        self.open_envs: np.ndarray | None = None
        # What the env holds after that step, for a producer that may continue from it.
        self.resume: Any = None

    def left(self, open_envs: np.ndarray, resume: Any = None) -> None:
        """The envs the producer's last recorded step left with an episode under way."""
        self.open_envs = np.asarray(open_envs, dtype=bool).copy()
        self.resume = resume


def claim(recorder: Any, owner: Any, name: str, resume: Any = None) -> Claim:
    """Make ``owner`` the producer of ``recorder``. ValueError when another one records into
    it; RecorderError when another one left episodes open and ``resume`` (what ``owner``'s
    env holds now) is not what that one's env held after its last recorded step."""
    held: Claim | None = getattr(recorder, "_producer", None)
    if held is not None and held.owner() is owner:
        held.closed = False
        return held
    if held is not None:
        if not held.closed and held.owner() is not None:
            raise ValueError(
                f"{name}: recorder: expected a recorder that no other wrapper or callback "
                f"records into (each numbers its envs from 0, so their episodes would be "
                f"joined), got one that a {held.name} records into; give each its own "
                f"RolloutRecorder (another worker_id)"
            )
        open_envs = [] if held.open_envs is None else np.flatnonzero(held.open_envs).tolist()
        if open_envs and (resume is None or resume is not held.resume):
            raise RecorderError(
                f"{name}: recorder: expected no episodes left open by the {held.name} that "
                f"recorded into it before (this one's first steps would continue them), got "
                f"envs {open_envs} with an episode under way; give this one its own "
                f"RolloutRecorder (another worker_id)"
            )
    taken = Claim(owner, name)
    if held is not None and held.open_envs is not None and resume is not None:
        taken.left(held.open_envs, held.resume)  # continued: the open episodes carry on
    recorder._producer = taken
    return taken
