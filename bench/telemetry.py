"""`crossover bench telemetry`: what recording costs, on both sides of the buffer.

    1. writer throughput: the recorder thread's write path (rows -> executemany
       -> commit, in `max_batch` transactions) as fast as it goes -> rows/s;
    2. caller cost, unpaced: CPU time of the calling thread per `record_step`
       over a tight loop (thread_time, so waits for the GIL don't count);
    3. caller cost, paced at 1,000 steps/s through a live recorder: wall time
       of each `record_step` call (perf_counter around it, so GIL waits and
       cold caches after the pacing sleep count) — this is the figure held to
       the target — next to the same loop calling a no-op, the caller thread's
       extra CPU over that no-op loop, the writer thread's CPU, drops, and a
       check that every row landed.

The target: recording 1,000 steps/s costs < 2% of one core on the caller's side.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import delete, func, select

from engine.types import StepStats
from store.db import make_engine, session_scope, shown_url
from store.migrate import ensure_schema
from store.models import Step
from telemetry.recorder import Recorder
from telemetry.writer import step_row, write_rows

PACED_RATE = 1000.0
TARGET_CORE_PERCENT = 2.0
INSTANCE = "bench"


def sample_step(i: int, t: float) -> StepStats:
    """A plausible speculative step (n-gram, depth 4, batch 8)."""
    return StepStats(
        step_id=i, time=t, batch_size=8, prefill_tokens=0, decode_tokens=19,
        technique="ngram", depth=4, proposed=32, accepted=11, accepted_per_pos=(6, 3, 1, 1),
        propose_ms=0.2, verify_ms=14.0, step_ms=15.1, kv_pages_used=120, kv_pages_free=880,
        queue_len=2, policy_version=3, preempted=0, tenants=("acme", "globex"),
    )  # fmt: skip


def run_bench(out_path: str | None, seconds: float, db_url: str | None) -> dict[str, Any]:
    """Run the three phases in about `seconds`, print progress, write JSON, return it."""
    with tempfile.TemporaryDirectory(prefix="xo-bench-") as tmp:
        url = db_url or f"sqlite:///{Path(tmp) / 'bench.db'}"
        ensure_schema(url)
        shown = shown_url(url)  # never print a password
        print(f"telemetry bench on {shown} for ~{seconds:.1f} s", flush=True)
        result: dict[str, Any] = {
            "db": shown if db_url else "temporary SQLite file",
            "seconds": seconds,
        }
        result["writer"] = _bench_writer(url, 0.35 * seconds)
        print(f"  writer: {result['writer']['rows_per_s']:,.0f} rows/s", flush=True)
        unpaced_n = int(min(50_000, 5_000 + seconds * 5_000))
        result["caller_unpaced"] = _bench_caller_unpaced(url, unpaced_n)
        print(
            f"  caller: {result['caller_unpaced']['cpu_us_per_step']:.2f} us CPU/step", flush=True
        )
        result["paced"] = _bench_paced(url, 0.65 * seconds)
        paced = result["paced"]
        print(_paced_summary(paced), flush=True)
        if db_url:
            _delete_bench_rows(url)
    result["rows_per_s"] = result["writer"]["rows_per_s"]
    result["caller_us_per_step"] = paced["caller_wall_us_mean"]
    result["caller_core_percent_at_1000"] = paced["caller_core_percent"]
    result["target_core_percent"] = TARGET_CORE_PERCENT
    result["meets_target"] = paced["caller_core_percent"] < TARGET_CORE_PERCENT
    if out_path:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out_path}", flush=True)
    return result


def _paced_summary(paced: dict[str, Any]) -> str:
    writer = paced["writer_core_percent"]
    return (
        f"  paced {paced['achieved_rate']:.0f} steps/s: caller {paced['caller_core_percent']:.3f}%"
        f" of a core ({paced['caller_wall_us_mean']:.1f} us/step), writer "
        + (f"{writer:.2f}%" if writer is not None else "n/a")
        + f", dropped {paced['dropped']}"
    )


def _bench_writer(url: str, seconds: float) -> dict[str, Any]:
    engine = make_engine(url)
    batch = 10_000 if seconds >= 2 else 2_000
    rows = [step_row(sample_step(i, 1.0e9 + i * 0.001), INSTANCE) for i in range(batch)]
    written, started = 0, time.perf_counter()
    try:
        while True:
            with engine.begin() as conn:
                write_rows(conn, rows, [])
            written += len(rows)
            elapsed = time.perf_counter() - started
            if elapsed >= seconds:
                break
    finally:
        engine.dispose()
    return {"rows": written, "batch": batch, "elapsed_s": elapsed, "rows_per_s": written / elapsed}


def _bench_caller_unpaced(url: str, n: int) -> dict[str, Any]:
    records = [sample_step(i, 2.0e9 + i * 0.001) for i in range(n)]
    recorder = Recorder(
        url, max_buffer=n, max_batch=n, instance=INSTANCE
    )  # not started: no GIL rival
    cpu0 = time.thread_time()
    for rec in records:
        recorder.record_step(rec)
    cpu = time.thread_time() - cpu0
    recorder.close(timeout=60)
    return {"steps": n, "cpu_us_per_step": cpu / n * 1e6}


def _bench_paced(url: str, seconds: float) -> dict[str, Any]:
    n = max(100, int(seconds / 2 * PACED_RATE))
    records = [sample_step(i, 3.0e9 + i / PACED_RATE) for i in range(n)]
    base_walls, base_cpu, _ = _paced_loop(records, lambda rec: True)
    recorder = Recorder(url, flush_interval_s=0.5, instance=INSTANCE).start()
    writer_cpu0 = recorder.writer_cpu_s()
    walls, cpu, elapsed = _paced_loop(records, recorder.record_step)
    recorder.flush(timeout=30)
    writer_cpu1 = recorder.writer_cpu_s()
    stats = recorder.stats()
    recorder.close(timeout=30)
    in_db = _count_rows(url, since=3.0e9)
    wall_us = sorted(w * 1e6 for w in walls)
    mean_us = statistics.fmean(wall_us)
    writer_cpu = (writer_cpu1 - writer_cpu0) if writer_cpu0 is not None and writer_cpu1 else None
    return {
        "steps": n,
        "achieved_rate": n / elapsed,
        "caller_wall_us_mean": mean_us,
        "caller_wall_us_p99": float(np.percentile(wall_us, 99, method="lower")),
        "caller_wall_us_max": wall_us[-1],
        "noop_call_wall_us_mean": statistics.fmean(base_walls) * 1e6,
        "caller_cpu_us_per_step_vs_noop": (cpu - base_cpu) / n * 1e6,
        "caller_core_percent": mean_us * PACED_RATE / 1e6 * 100,
        "writer_core_percent": writer_cpu / elapsed * 100 if writer_cpu is not None else None,
        "dropped": stats["dropped"],
        "rows_in_db": in_db,
        "all_rows_written": in_db == n,
        "flushes": stats["flushes"],
    }


def _paced_loop(records: list[StepStats], call: Any) -> tuple[list[float], float, float]:
    """Call `call(rec)` at PACED_RATE; return per-call wall times, thread CPU, elapsed."""
    walls: list[float] = []
    cpu0, started = time.thread_time(), time.perf_counter()
    for i, rec in enumerate(records):
        delay = started + i / PACED_RATE - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        t0 = time.perf_counter()
        call(rec)
        walls.append(time.perf_counter() - t0)
    return walls, time.thread_time() - cpu0, time.perf_counter() - started


def _count_rows(url: str, since: float) -> int:
    engine = make_engine(url)
    try:
        with session_scope(engine) as session:
            query = select(func.count()).where(Step.instance == INSTANCE, Step.time >= since)
            return int(session.scalar(query) or 0)
    finally:
        engine.dispose()


def _delete_bench_rows(url: str) -> None:
    """Leave a real database as it was: the bench's rows carry instance "bench"."""
    engine = make_engine(url)
    try:
        with session_scope(engine) as session:
            session.execute(delete(Step).where(Step.instance == INSTANCE))
    finally:
        engine.dispose()


if __name__ == "__main__":  # pragma: no cover
    run_bench(os.environ.get("OUT"), float(os.environ.get("SECONDS", "6")), os.environ.get("DB"))
