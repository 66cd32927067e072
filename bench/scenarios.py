"""The benchmark registry: every scenario `run.py` knows, in the order it runs them.

A scenario takes a `Context` and returns a JSON-able dict of measurements; its
`rows` function turns the results of the whole run into table rows (so a row
can compare against another scenario). Each family lives in its own module
(`latency`, `jax_rollout`, `torch_sb3`, `finish`, `server_cpu`, `ingest`, `side_by_side`,
`fleet`, `baselines`, `vs_reverb`) over the shared `harness`. New rows are a few lines: for
example,

    SCENARIOS.append(ingest_scenario(
        "ingest_4w_no_wal", workers=4, serve_args=("--no-wal",), compare_to="ingest_4w"))

runs the 4-worker ingest against a server started with that flag and adds a
row "ours vs ingest_4w". `--serve-args` on the command line appends flags to
every recorder server of the run.
"""

from __future__ import annotations

from baselines import raw_scenario, ray_scenario
from finish import rows_finish, run_finish
from fleet import fleet_scenario, steady_scenario
from gym_wrapper import rows_gym_record_rollouts, run_gym_record_rollouts
from harness import PREVIOUS_CORE, Scenario
from ingest import ingest_scenario, rows_idle_streams, rows_previous_core
from jax_rollout import rows_latency_jax, run_latency_jax
from latency import rows_latency, run_latency
from server_cpu import rows_server_cpu, run_server_cpu
from side_by_side import side_by_side_scenario
from torch_sb3 import rows_latency_torch, rows_sb3_ppo, run_latency_torch, run_sb3_ppo
from vs_reverb import reverb_scenario

# -- the registry ---------------------------------------------------------------
# SCENARIOS run by default, in this order (repeated ones in interleaved rounds).
# OPTIONAL_SCENARIOS run only when named: `--only NAME` or `--with NAME`.

SCENARIOS: list[Scenario] = [
    Scenario("latency", run_latency, rows_latency, description="record() caller latency"),
    Scenario(
        "latency_jax",
        run_latency_jax,
        rows_latency_jax,
        description="record() caller latency with jax.Array input from a jax.jit rollout (CPU)",
    ),
    Scenario(
        "latency_torch",
        run_latency_torch,
        rows_latency_torch,
        description="record() caller latency with torch CPU tensors, in turns with numpy",
    ),
    Scenario(
        "sb3_ppo",
        run_sb3_ppo,
        rows_sb3_ppo,
        description="SB3 PPO training steps/s with RecorderCallback vs without, in turns",
    ),
    Scenario(
        "gym_record_rollouts",
        run_gym_record_rollouts,
        rows_gym_record_rollouts,
        description="RecordRollouts on CartPole, 8 SyncVectorEnv envs, against the bare loop",
    ),
    Scenario("finish", run_finish, rows_finish, description="finish() on >= 20k episodes"),
    Scenario(
        "server_cpu",
        run_server_cpu,
        rows_server_cpu,
        description="server CPU per chunk with/without metrics and store, in process",
    ),
    ingest_scenario("ingest_1w", workers=1),
    ingest_scenario("ingest_4w", workers=4, verify_lag=True),
    ingest_scenario("ingest_8w", workers=8),
    fleet_scenario(
        "ingest_256w",
        processes=8,
        recorders=32,
        num_envs=16,
        chunks=10,
        window=2,
    ),
    # Reverb fed the same chunks as items: right after ingest_256w, and in the rounds of
    # ingest_4w (bench/vs_reverb.py; skipped without bench/.venv-reverb).
    reverb_scenario(
        "reverb_256w",
        processes=8,
        threads=32,
        num_envs=16,
        chunks=10,
        window=2,
        compare_to="ingest_256w",
        repeated=False,
    ),
    steady_scenario(
        "fleet_steady",
        fleets=(256, 512, 1024),
        processes=8,
        length=32,
        num_envs=4,
        period_s=1.0,
        seconds=6,
        bound_ms=50,
    ),
    raw_scenario("raw_grpc_1w", workers=1),
    raw_scenario("raw_grpc_4w", workers=4),
    ray_scenario("ray_1w", workers=1),
    ray_scenario("ray_4w", workers=4),
    ray_scenario("ray_8w", workers=8),
    reverb_scenario(
        "reverb_4w",
        processes=4,
        threads=1,
        num_envs=256,
        chunks=None,
        window=None,
        compare_to="ingest_4w",
        repeated=True,
    ),
    # Configuration rows, each compared with ingest_4w (the defaults: no store, metrics on,
    # write-ahead log with fsync "batch"); the dashboard row with its no-metrics twin.
    ingest_scenario(
        "ingest_4w_store_on",
        workers=4,
        capture=True,
        compare_to="ingest_4w",
        description="ingest, 4 workers, trajectory store on (2 cell fields, 1 utility)",
    ),
    # Metrics (alone, and with the dashboard) against --no-metrics: three servers fed in
    # turns, a fraction of a second each, so that all see the same background load (the
    # cost is smaller than the load's swings between rounds run one after the other).
    side_by_side_scenario("ingest_4w_dashboard_turns", workers=4, bursts=16, chunks=16),
    ingest_scenario(
        "ingest_4w_dataset_local",
        workers=4,
        dataset="local",
        compare_to="ingest_4w",
        description="ingest, 4 workers, dataset sink writing Parquet to a local directory",
    ),
    ingest_scenario(
        "ingest_4w_dataset_s3",
        workers=4,
        dataset="s3",
        compare_to="ingest_4w",
        description="ingest, 4 workers, dataset sink writing Parquet to a local S3 server",
    ),
    ingest_scenario(
        "ingest_4w_idle_200",
        workers=4,
        idle_streams=200,
        rows=rows_idle_streams,
        description="ingest, 4 busy workers beside 200 workers holding open streams, no data",
    ),
    ingest_scenario(
        "ingest_4w_previous_core",
        workers=4,
        previous_core=True,
        rows=rows_previous_core,
        description=f"ingest, 4 workers, into the previous server core ({PREVIOUS_CORE})",
    ),
    # The pixel workload: a (T, N, 84, 84) uint8 frame state field, against the same bytes
    # over the raw gRPC stream.
    ingest_scenario(
        "ingest_4w_pixels",
        workers=4,
        pixels=True,
        references=(("raw_grpc_4w_pixels", "raw gRPC bytes stream, pixel workload, 4w"),),
        description="ingest, 4 workers, pixel workload (84x84 uint8 frames)",
    ),
    raw_scenario("raw_grpc_4w_pixels", workers=4, pixels=True),
]

OPTIONAL_SCENARIOS: list[Scenario] = [
    # Reverb as an actor stepping a vector env feeds it: T appends of one time step, then an
    # item over the last T (the default rows append each chunk whole: Reverb's cheapest way).
    reverb_scenario(
        "reverb_256w_steps",
        processes=8,
        threads=32,
        num_envs=16,
        chunks=10,
        window=2,
        compare_to="ingest_256w",
        repeated=False,
        per_step=True,
    ),
    reverb_scenario(
        "reverb_4w_steps",
        processes=4,
        threads=1,
        num_envs=256,
        chunks=None,
        window=None,
        compare_to="ingest_4w",
        repeated=True,
        per_step=True,
    ),
    # --no-metrics beside ingest_4w, in rounds one after the other: the load's swings
    # between rounds are larger than the cost (the target reads the in-turns rows).
    ingest_scenario(
        "ingest_4w_no_metrics",
        workers=4,
        serve_args=("--no-metrics",),
        compare_to="ingest_4w",
        description="ingest, 4 workers, server keeping no metrics",
    ),
    # The same cost, measured one server after the other (3x the chunks, several polls a
    # run); the default row above feeds both at once.
    ingest_scenario(
        "ingest_4w_no_metrics_long",
        workers=4,
        serve_args=("--no-metrics",),
        longer=3,
        compare_to="ingest_4w",
        description="ingest, 4 workers, 3x the chunks, server keeping no metrics",
    ),
    ingest_scenario(
        "ingest_4w_dashboard",
        workers=4,
        dashboard=True,
        longer=3,
        compare_to="ingest_4w_no_metrics_long",
        description="ingest, 4 workers, 3x the chunks, metrics on and the dashboard polled "
        "once a second",
    ),
    # Configuration rows without a target, each beside ingest_4w (`--with` names them;
    # they kept the full run over 10 minutes on a busy day).
    ingest_scenario(
        "ingest_4w_all_sinks",
        workers=4,
        serve_args=(
            "--metrics-listen",
            "127.0.0.1:0",
            "--tensorboard-dir",
            "{tmp}/tb",
            "--metrics-jsonl",
            "{tmp}/metrics.jsonl",
        ),
        compare_to="ingest_4w",
        description="ingest, 4 workers, Prometheus + TensorBoard + JSONL sinks on",
    ),
    ingest_scenario(
        "ingest_4w_fsync_always",
        workers=4,
        serve_args=("--wal-fsync", "always"),
        compare_to="ingest_4w",
        description="ingest, 4 workers, write-ahead log fsync before every ack",
    ),
    ingest_scenario(
        "ingest_4w_fsync_never",
        workers=4,
        serve_args=("--wal-fsync", "never"),
        compare_to="ingest_4w",
        description="ingest, 4 workers, write-ahead log without fsync",
    ),
    ingest_scenario(
        "ingest_4w_no_wal",
        workers=4,
        serve_args=("--no-wal",),
        compare_to="ingest_4w",
        description="ingest, 4 workers, no write-ahead log at all",
    ),
    # Diagnostic: does glibc's malloc keep the server's freed decode buffers? (same code,
    # only the server's environment differs; compare the memory rows with ingest_4w).
    ingest_scenario(
        "ingest_4w_mmap_threshold",
        workers=4,
        serve_env={"MALLOC_MMAP_THRESHOLD_": "131072"},
        description="ingest, 4 workers, server with a fixed glibc mmap threshold",
    ),
    # Diagnostic: faster zstd levels on the client (more bytes on the wire, less CPU on
    # both sides); compare with ingest_4w (level 1).
    *(
        ingest_scenario(
            f"ingest_4w_level_{name}",
            workers=4,
            compression_level=level,
            compare_to="ingest_4w",
            description=f"ingest, 4 workers, client zstd level {level}",
        )
        for name, level in (("m1", -1), ("m3", -3), ("m7", -7))
    ),
]
