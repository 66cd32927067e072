"""Finished episodes on their way to the trajectory store and the metrics, off the ack path.

- `feeder`: the per-session thread and its batches;
- `tails`: returns and outcomes carried across chunks;
- `window`: every held step's cell keys and reward, read in place by the store;
- `held`: the chunks open episodes still need, and stored episodes read back from them;
- `buffers`: reused decode buffers.
"""

from .feeder import ChunkEpisodes, EpisodeFeeder

__all__ = ["ChunkEpisodes", "EpisodeFeeder"]
