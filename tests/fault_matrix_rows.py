"""The crash-safety guarantees, one row per fault: the single source that
tests/test_fault_matrix.py checks against a real server and that the crash-safety table in
docs/crash-safety.md must equal (test_the_crash_safety_table_matches_the_fault_matrix).

Each row says what the trainer sees (`trainer`: an exception class, a gRPC status code, or
"nothing"; `told`: a part of its message), and what the server's log says (`log`: a part of
its stderr, at --log-level INFO). What finish(), the dataset and the store hold is stated in `guarantee` and
checked against the truth the test computes from the chunks it sent.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs" / "crash-safety.md"


@dataclass(frozen=True)
class Row:
    key: str
    fault: str
    guarantee: str
    trainer: str
    told: str
    log: str | None
    """None: the server logs no warning or error (the refused client is told)."""


ROWS: tuple[Row, ...] = (
    Row(
        key="kill-9",
        fault="The server is killed (`kill -9`) while a worker records",
        guarantee=(
            "Nothing acknowledged is lost: the worker reconnects and resends what was not "
            "acknowledged; `finish()`, the dataset and the store hold every chunk once"
        ),
        trainer="nothing",
        told="",
        log="replayed",
    ),
    Row(
        key="torn-unacked-tail",
        fault="The log ends in a torn record that was never acknowledged (a kill mid-append)",
        guarantee=(
            "The torn bytes are dropped and reported at start; every acknowledged chunk is kept"
        ),
        trainer="nothing",
        told="",
        log="dropped torn tail of 10 bytes",
    ),
    Row(
        key="torn-acked-tail",
        fault=(
            "The log loses acknowledged chunks 8..10 of a worker (`kill -9`, then its tail cut "
            "inside chunk 8's record), and the worker records on"
        ),
        guarantee=(
            "The worker is told which chunks were lost and why; every open episode of it ends "
            "at the hole: `finish()`, the dataset and the store hold each episode clear of the "
            "hole whole and none joined across it (the piece after the hole, up to its first "
            "done, only with `include_partial=True`, marked `gap_before`)"
        ),
        trainer="DataLossError",
        told="lost chunks 8..10",
        log="chunks 8..10 were acknowledged but are not held",
    ),
    Row(
        key="unexplained-loss",
        fault=(
            "Under `--wal-fsync always` the log loses acknowledged chunks with no torn record "
            "left (cut at a record boundary): no cause the server can name"
        ),
        guarantee=(
            "The worker's rejoin is refused (`InvalidChunkError` naming its claim and what the "
            "server holds), never counted as a power cut; every chunk still held is returned"
        ),
        trainer="InvalidChunkError",
        told="acked_sequence: expected at most 4",
        log="recovery: replayed 5 log records",  # its join and chunks 1..4
    ),
    Row(
        key="corrupt-newest-checkpoint",
        fault="The newest checkpoint is corrupt (one flipped byte), then `kill -9`",
        guarantee=(
            "Recovery skips it, loads the older checkpoint and replays the log behind it: "
            "nothing is lost"
        ),
        trainer="nothing",
        told="",
        log="skipping unusable checkpoint",
    ),
    Row(
        key="drop-then-corrupt-checkpoint",
        fault=(
            "Another session is dropped, this one records on, then `kill -9` and the newest "
            "checkpoint has a flipped byte"
        ),
        guarantee=(
            "Recovery falls back to the other kept checkpoint and replays the log behind it: "
            "every acknowledged chunk of this session is kept, and the dropped session does "
            "not come back"
        ),
        trainer="nothing",
        told="",
        log="fell back to an older checkpoint",
    ),
    Row(
        key="previous-format-data-dir",
        fault="The data directory was written by the previous format version",
        guarantee=(
            "The server reads it as it is (`rollout-recorder upgrade` converts it in place "
            "after a backup): every chunk it holds is returned, and recording goes on"
        ),
        trainer="nothing",
        told="",
        log="replayed 4 log records",
    ),
    Row(
        key="unary-call-during-restart",
        fault="`status()` and `list_sessions()` are called while the server restarts",
        guarantee=(
            "They wait for it up to `connect_timeout` (`timeout` for `list_sessions()`) and "
            "answer; nothing acknowledged is lost"
        ),
        trainer="nothing",
        told="",
        log="replayed",
    ),
    Row(
        key="zstd-bomb",
        fault="A zstd bomb: a chunk of a few KiB whose header declares a 1 GiB array",
        guarantee=(
            "Refused from its header before anything is decompressed (INVALID_ARGUMENT "
            "naming the field); the session and its other workers are untouched"
        ),
        trainer="INVALID_ARGUMENT",
        told="chunk.action.raw_size",
        log="of 'bomber' refused: chunk.action.raw_size",
    ),
    Row(
        key="lying-size",
        fault="A chunk whose zstd frame holds fewer bytes than its header declares",
        guarantee=(
            "Refused before its ack (INVALID_ARGUMENT naming the field); the session and "
            "its other workers are untouched"
        ),
        trainer="INVALID_ARGUMENT",
        told="chunk.action.data",
        log="of 'liar' refused: chunk.action.data",
    ),
    Row(
        key="corrupt-frame",
        fault=(
            "An acknowledged chunk's frame does not decode (its header checks passed; a state "
            "field read after the ack)"
        ),
        guarantee=(
            "`finish()` names the chunk (`DataLossError` carrying the result) and marks each "
            "episode over it `corrupt`; the dataset marks them too (`read_episodes` leaves "
            "them out unless `include_partial=True`); the store holds none of them"
        ),
        trainer="DataLossError",
        told="player_inventory frame does not decode",
        log="player_inventory frame does not decode",
    ),
    Row(
        key="bad-shape",
        fault="`record()` gets a chunk whose arrays do not share one `(T, N)`",
        guarantee=(
            "`record()` raises `InvalidChunkError` naming the field before it returns and "
            "queues nothing; every other chunk is stored"
        ),
        trainer="InvalidChunkError",
        told="trajectories.reward: expected shape (T, N) = (16, 3), got (16, 2)",
        log=None,
    ),
    Row(
        key="changed-dtype",
        fault="`record()` gets a chunk whose action dtype differs from the worker's earlier chunks",
        guarantee=(
            "`record()` raises `InvalidChunkError` naming the field and both dtypes before it "
            "returns and queues nothing; every other chunk is stored"
        ),
        trainer="InvalidChunkError",
        told="action.dtype: expected int64 like this worker's earlier chunks, got int32",
        log=None,
    ),
    Row(
        key="late-refusal",
        fault=(
            "The server refuses a chunk after `record()` returned (its action dtype differs "
            "from another worker's in the session)"
        ),
        guarantee=(
            "The recorder's next call of any kind (here `is_full`) raises `InvalidChunkError` "
            "naming the field; every acknowledged chunk is stored"
        ),
        trainer="InvalidChunkError",
        told="chunk.action.dtype: expected int64 like the session's earlier chunks, got int32",
        log="chunk 1 of 'w1' refused: chunk.action.dtype",
    ),
    Row(
        key="worker-id-in-use",
        fault="A second recorder opens with the `worker_id` of a live one",
        guarantee=(
            "The second raises `WorkerIdInUseError` before it records; every chunk the first "
            "acknowledged is stored"
        ),
        trainer="WorkerIdInUseError",
        told="own worker_id",
        log=None,
    ),
    Row(
        key="overclaiming-join",
        fault="A Join claims an `acked_sequence` beyond anything the server acknowledged",
        guarantee=(
            "Refused (INVALID_ARGUMENT naming both numbers); the live worker's chunks are all "
            "stored and nothing is counted lost"
        ),
        trainer="INVALID_ARGUMENT",
        told="acked_sequence",
        log=None,
    ),
    Row(
        key="drop-while-recording",
        fault="The session is dropped while a worker records",
        guarantee=(
            "The worker gets `SessionDroppedError` on its next call and does not re-create "
            "the session; episodes it finished before the drop are in the dataset; a new "
            "recorder starts the session empty"
        ),
        trainer="SessionDroppedError",
        told="dropped at",
        log="session 'drop-while-recording' dropped",
    ),
    Row(
        key="drop-then-kill-9",
        fault="The session is dropped, then the server is killed (`kill -9`) and restarts",
        guarantee=(
            "The drop outlives the restart: the worker gets `SessionDroppedError` and does not "
            "re-create the session; episodes it finished before the drop are in the dataset "
            "once; a new recorder starts the session empty"
        ),
        trainer="SessionDroppedError",
        told="dropped at",
        log="replayed",
    ),
)


def markdown_table(rows: tuple[Row, ...] = ROWS) -> str:
    """The crash-safety table as docs/crash-safety.md holds it."""
    lines = ["| Fault | Guarantee |", "| --- | --- |"]
    lines += [f"| {row.fault} | {row.guarantee} |" for row in rows]
    return "\n".join(lines) + "\n"


def write_table(page: Path = DOCS) -> None:
    """Replace the table in the page with the rows' (the text around it stays)."""
    text = page.read_text()
    start = text.index("| Fault | Guarantee |")
    end = text.find("\n\n", start)
    end = len(text) if end < 0 else end + 1
    page.write_text(text[:start] + markdown_table() + text[end:])


if __name__ == "__main__":
    # `python tests/fault_matrix_rows.py` prints the table; with --write, puts it in the page.
    if sys.argv[1:] == ["--write"]:
        write_table()
    else:
        print(markdown_table(), end="")
