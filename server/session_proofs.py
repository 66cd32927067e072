"""Proving a session's frames that were acknowledged on their headers (see ingest.verify): each
stored chunk once, by whichever reader or the background verifier gets to it first. A frame
that does not decode is replaced by zeros, and the chunk says why (`StoredChunk.corrupt`)."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from .chunks import zero_frame
from .episodes import StoredChunk

logger = logging.getLogger("recorder_server.session")


class FrameProofs:
    """The proofs of a `Session` (its _verify_lock, _unverified queue and _late messages)."""

    def verify(self, chunks: Iterable[StoredChunk]) -> None:
        """Prove these chunks' frames decode before they are read (finish(), the dataset
        sink); each one is proved once, here or by the background verifier."""
        for chunk in chunks:
            if chunk.unverified:
                self._verify_chunk(chunk)

    def verify_some(self, limit: int) -> None:
        for _ in range(limit):
            try:
                chunk = self._unverified.popleft()
            except IndexError:
                return
            if chunk.unverified:
                self._verify_chunk(chunk)

    def verify_pending(self) -> int:
        return len(self._unverified)

    def take_late_refusals(self, worker_id: str) -> list[str]:
        """Messages about this worker's chunks found not to decode since it was last told."""
        if not self._late:
            return []
        with self._verify_lock:
            return self._late.pop(worker_id, [])

    def unverified_chunks(self) -> int:
        """Stored chunks whose frames are not yet proved (the queue may hold some a reader
        proved first)."""
        return sum(1 for c in list(self._unverified) if c.unverified)

    def _verify_chunk(self, chunk: StoredChunk) -> None:
        # Marked verified only once done: a reader that finds it verified reads final frames.
        with self._verify_lock:
            corrupt = False
            for key in chunk.unverified:
                enc = chunk.arrays[key]
                try:
                    enc.prove(f"chunk.{key}")
                except ValueError as exc:
                    chunk.arrays[key] = zero_frame(enc)
                    corrupt = True
                    if chunk.worker and chunk.sequence:
                        origin = f"chunk {chunk.sequence} of worker {chunk.worker!r}"
                    elif chunk.worker:
                        origin = f"the chunk at step {chunk.t0} of worker {chunk.worker!r}"
                    else:
                        origin = f"the chunk at step {chunk.t0}"
                    message = (
                        f"{origin} was acknowledged, but its {key} frame does not decode "
                        f"({exc}); it reads as zeros"
                    )
                    chunk.corrupt = (*chunk.corrupt, message)
                    logger.warning("session %r: %s", self.name, message)
                    if chunk.worker:
                        self._late.setdefault(chunk.worker, []).append(message)
            if corrupt:  # a chunk, however many of its frames
                self.metrics.inc("Recorder/chunks_corrupt", 1, session=self.name)
            chunk.unverified = ()
