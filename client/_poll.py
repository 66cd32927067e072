"""Which one recorder of a process may poll its queue instead of sleeping until woken.

Waking a sleeping sender thread costs record() a futex wake: 10-70 us on an idle core of a
VM, more than the rest of the call after a training step. So one sender a process, while
its chunks come at most POLL_GAP_S apart, looks at its queue every POLL_S without the lock,
and record() skips the wake; after POLL_QUIET_S without a chunk it sleeps again. One a
process, so that a process driving many recorders (a fleet of actors) polls once, not once
per recorder.

Polling pays only while the caller leaves the GIL free between calls (a sleep, a wait on the
GPU). A caller busy in Python between calls (a Gymnasium loop stepping its envs) hands the GIL
to each poll: a forced switch every few milliseconds that costs its loop more than record()'s
wake. A poll that gets the GIL back POLL_LATE_S late says so, and the sender then sleeps until
woken for POLL_BACKOFF_S (bench `gym_record_rollouts`). The sender process's child never
polls: the wake it would save is its own, not the training loop's.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

POLL_S = 0.001
POLL_GAP_S = 0.02
POLL_QUIET_S = 0.05
POLL_LATE_S = 0.002
POLL_BACKOFF_S = 0.25
_poll_slot: list[Any] = [None]  # a weak reference to the sender that polls
_poll_lock = threading.Lock()


def claim_poll(sender: Any, want: bool) -> bool:
    """Whether `sender` may poll now (taking the process's one slot if free); `want` False
    gives the slot back."""
    with _poll_lock:
        holder = _poll_slot[0]() if _poll_slot[0] is not None else None
        if holder is sender:
            if not want:
                _poll_slot[0] = None
            return want
        if want and holder is None:
            _poll_slot[0] = weakref.ref(sender)
            return True
        return False
