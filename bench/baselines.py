"""The reference rows: a Ray actor around factoriax, and raw gRPC bytes streamed to a server
that does nothing with them."""

from __future__ import annotations

from typing import Any

from chunks import STATE_FIELDS
from harness import (
    Context,
    Scenario,
    Skipped,
    aggregate,
    worker_spec,
)
from procs import (
    RawGrpcServer,
    proc_cpu_s,
    run_workers,
)

# -- (c) baselines: Ray actor around factoriax, raw gRPC bytes -----------------


def ray_scenario(name: str, *, workers: int) -> Scenario:
    def run(ctx: Context, rep: int) -> dict[str, Any]:
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            raise Skipped("ray is not installed (pip install -r bench/requirements.txt)")
        ray = ctx.ray()
        from ray_recorder import NAMESPACE, FactoriaxRecorderActor

        actor_name = f"factoriax-recorder-{name}-{rep}"
        actor = (
            ray.remote(FactoriaxRecorderActor)
            .options(name=actor_name, namespace=NAMESPACE)
            .remote(True, list(STATE_FIELDS))
        )
        actor_pid = ray.get(actor.ping.remote(), timeout=120)
        try:
            cpu0 = proc_cpu_s(actor_pid)
            address = ray.get_runtime_context().gcs_address
            specs = [
                worker_spec(
                    ctx,
                    "ray",
                    i,
                    ray_address=address,
                    ray_namespace=NAMESPACE,
                    actor=actor_name,
                    window=ctx.params.ray_window,
                )
                for i in range(workers)
            ]
            results, go_ns, machine = run_workers(specs, ctx.tmp / f"{name}-{rep}")
            out = aggregate(ctx, results, go_ns, machine)
            out["actor_cpu_s"] = proc_cpu_s(actor_pid) - cpu0
            out["actor"] = ray.get(actor.stats.remote(), timeout=120)
            out["window"] = ctx.params.ray_window
            return out
        finally:
            ray.kill(actor)

    return Scenario(
        name, run, description=f"Ray actor wrapping factoriax, {workers} workers", repeated=True
    )


def raw_scenario(name: str, *, workers: int, pixels: bool = False) -> Scenario:
    def run(ctx: Context, rep: int) -> dict[str, Any]:
        d = ctx.tmp / f"{name}-{rep}"
        d.mkdir(parents=True, exist_ok=True)
        server = RawGrpcServer(d / "server.log")
        try:
            cpu0 = server.cpu_s()
            specs = [
                worker_spec(ctx, "raw", i, pixels=pixels, target=server.address)
                for i in range(workers)
            ]
            results, go_ns, machine = run_workers(specs, d)
            out = aggregate(ctx, results, go_ns, machine, num_envs=specs[0]["num_envs"])
            out["server_cpu_s"] = server.cpu_s() - cpu0
            out["server_vm"] = server.status()
            return out
        finally:
            server.stop()

    what = ", pixel workload" if pixels else ""
    return Scenario(
        name, run, description=f"raw gRPC bytes stream, {workers} workers{what}", repeated=True
    )
