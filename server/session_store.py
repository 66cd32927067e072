"""A session's trajectory store verbs: episodes submitted whole, curriculum starts, the cell
archive and the store's checkpoints (the `Session` mixes them in)."""

from __future__ import annotations

from recorder_client.capture_types import EpisodeOutcome, TrajectorySliceReference

from .chunks import SubmittedEpisode
from .durability import records
from .durability.checkpoint import CheckpointError, decode_checkpoint, encode_checkpoint
from .errors import ErrorKind, RequestError, invalid
from .store import EpisodeArrays


class StoreVerbs:
    """The store verbs of a `Session` (its lock, processor, feeder and journal)."""

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until the store and metrics reflect every chunk taken so far."""
        return self.feeder.drain(timeout)

    def submit_episode(self, episode: SubmittedEpisode, *, log: bool = True) -> int:
        """Record one whole episode (emulator-style producers); returns the episodes captured."""
        self.touch()
        self.drain()
        try:
            outcome = EpisodeOutcome(episode.outcome)
        except ValueError:
            raise invalid(
                f"outcome: expected 0..{max(EpisodeOutcome)}, got {episode.outcome}"
            ) from None
        try:
            arrays = EpisodeArrays(
                episode.arrays["actions"].decode("episode.actions"),
                episode.arrays["rewards"].decode("episode.rewards"),
                {
                    k[len("state:") :]: a.decode(f"episode.states[{k[6:]!r}]")
                    for k, a in episode.arrays.items()
                    if k.startswith("state:")
                },
            )
        except (KeyError, ValueError) as exc:
            raise invalid(f"episode: {exc}") from None
        reference = None
        if episode.start_reference is not None:
            reference = TrajectorySliceReference(*episode.start_reference)
        with self.lock:
            if log and self.journal is not None:
                self._journal(records.episode(self.name, episode))
            try:
                self.processor.record_episode(
                    arrays,
                    dict(episode.episode_data),
                    episode.step,
                    outcome=outcome,
                    start_reference=reference,
                )
            except ValueError as exc:
                raise invalid(f"episode: {exc}") from None
        self.processor.log_metrics(episode.step)
        return self.processor.runtime_state_dict()["counters"]["episodes_captured"]

    def require_store(self, verb: str) -> None:
        if self.processor.store is None:
            raise RequestError(
                ErrorKind.NO_STORE,
                f"{verb}: session {self.name!r} has no trajectory store (it was created "
                "without capture=)",
            )

    def sample_start(self) -> tuple[TrajectorySliceReference, EpisodeArrays] | None:
        self.touch()
        self.drain()
        return self.processor.sample_start()

    def snapshot_potential(self, utility_key: str, field_names: list[str]) -> dict:
        self.touch()
        self.drain()
        try:
            return self.processor.snapshot_potential(utility_key, field_names)
        except ValueError as exc:
            raise RequestError(ErrorKind.INVALID_QUERY, str(exc)) from None

    def archive(self) -> dict | None:
        """The cell archive as numpy columns after every chunk taken so far reached the store
        (`TrajectoryCaptureProcessor.archive_table`); None without a store."""
        self.touch()
        self.drain()
        return self.processor.archive_table()

    def store_checkpoint(self, compress: bool, step: int) -> tuple[str, bytes] | None:
        """The store as (file name, bytes in the checksummed checkpoint format), or None
        without a store."""
        self.drain()
        file = self.processor.trajectory_store_checkpoint_file(compress, checkpoint_step=step)
        if file is None:
            return None
        return file.name, encode_checkpoint(file.data, compress=False)

    def load_store_checkpoint(self, data: bytes, max_bytes: int | None = None) -> None:
        """Replace the store with one from store_checkpoint (of any server); ``max_bytes``
        bounds the file as framed and as decompressed, before either is expanded."""
        self.require_store("store checkpoint")
        self.drain()
        try:
            payload = decode_checkpoint(
                data, max_payload_bytes=max_bytes, source="store checkpoint"
            )
            self.processor.load_trajectory_store_checkpoint_data(payload, max_bytes=max_bytes)
        except (CheckpointError, ValueError) as exc:
            raise invalid(f"store checkpoint: {exc}") from None
