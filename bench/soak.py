"""`crossover bench soak`: a daemon under well-formed and hostile traffic, then an audit.

1. Start `crossover serve` as a child process on a free loopback port with its defaults
   (the real model unless `--fake`), a fresh SQLite telemetry database, an admin token and
   API keys required (`--no-open`), plus `--serve-arg`s; wait until /ready says every
   technique is ready. Two tenants: `soak-clients` (the well-formed load) and
   `soak-hostile` (max 4 concurrent, 2 queued: its clients' requests that reach the engine).
2. Rehearsal: step 3 in small (twice `--concurrency` well-formed requests), so that what
   the daemon makes once and keeps (pooled database connections, a replaced search
   process, allocator arenas) is part of the level measured next. Its problems count.
   Baseline: the well-formed load alone: `--well-formed` requests (bench.workloads
   prompts, three in four streamed, greedy or seeded) from `--concurrency` clients, the
   prefix cache emptied first. Then, idle, the daemon's RSS, open descriptors and OS
   threads: the level the soak must return to.
3. Soak: the same load again (prefix cache emptied) beside `--hostile` connection-level
   hostile connections held at once (slowloris headers, idle sockets, stalled bodies) and
   `--engine-hostile` clients whose requests reach the engine (streams nobody reads, slow
   readers, hang-ups mid-stream and before the answer), every bad input of
   `bench.soak_clients.bad_cases` in turn, paced to spread `--requests` over the time the
   baseline took (a wrong admin token at most every 10 s, under the guess throttle), and an admin pinning
   valid policies and unpinning; once, a retune whose search process is killed (SIGKILL) as it starts, then a
   retune that must end normally. When the well-formed load is done the hostile clients stop and bad inputs
   continue until `--requests` requests were sent in all.
4. Audit, once the daemon is idle: /health 200 with no engine restart; no request in
   flight; every KV page back (used 0, free = total); every worker thread up; one
   telemetry row per request the engine finished (xo_requests = /metrics' requests, each
   well-formed request's id once) and none dropped; RSS and descriptors within
   `--tolerance` of the baseline level; no 5xx answered to anyone; every bad input its
   documented 4xx with an OpenAI error object; the well-formed TTFT p99 within
   `--ttft-ratio` of the baseline's; no traceback in the daemon's log. Then SIGTERM:
   the daemon must exit 0.
5. JSON: each check (`passed` and what it measured), both phases' latencies, the hostile
   and bad-input tallies; `ok` when every check passed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from bench.soak_daemon import Daemon, Note, SoakConfig
from bench.soak_run import Soak

# ---- the audit ----------------------------------------------------------------------------

def scrape(text: str) -> dict[str, float]:
    """Each sample name of a /metrics page with its values summed over the labels."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def request_rows(db_path: Path) -> list[str]:
    """The request ids of the telemetry database's xo_requests rows."""
    from sqlalchemy import create_engine, select

    from store.models import Request as RequestRow

    engine = create_engine(f"sqlite:///{db_path}")
    try:
        with engine.connect() as conn:
            return [row[0] for row in conn.execute(select(RequestRow.request_id))]
    finally:
        engine.dispose()


def within(before: int, after: int, tolerance: float) -> bool:
    return abs(after - before) <= tolerance * before


async def audit(soak: Soak, result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The checks of the module docstring's step 4, each with `passed`."""
    cfg, tally, d = soak.cfg, soak.tally, soak.d
    checks: dict[str, dict[str, Any]] = {}
    status = await soak.idle()
    code, health = await soak.get("/health", admin=False)
    checks["health"] = {"passed": code == 200 and health == {"status": "ok", "engine_restarts": 0},
                        "status": code, "answer": health}
    queue, pool = status["queue"], status["pool"]
    checks["nothing_in_flight"] = {"passed": not any(queue.values()), **queue}
    checks["kv_pages_back"] = {"passed": pool["pages_used"] == 0
                               and pool["pages_free"] == pool["pages_total"],
                               **pool}
    _, metrics_text = await soak.get("/metrics")
    metrics = scrape(metrics_text)
    up = {k: v for k, v in status["threads"].items() if v is not None}
    checks["threads_up"] = {"passed": bool(up) and all(up.values())
                            and metrics.get("crossover_thread_up") == len(up),
                            **status["threads"]}
    finished = int(metrics.get("crossover_requests_total", -1))
    end, rows = time.monotonic() + 60, request_rows(d.db_path)
    while len(rows) < finished and time.monotonic() < end:
        await asyncio.sleep(1.0)
        rows = request_rows(d.db_path)
    answered = [a.request_id for phase in result["answers"] for a in phase if a.status == 200]
    missing = [rid for rid in answered if rid not in set(rows)]
    dropped = (status.get("recorder") or {}).get("dropped")
    checks["telemetry_rows"] = {
        "passed": len(rows) == len(set(rows)) == finished and not missing and dropped == 0,
        "rows": len(rows), "distinct": len(set(rows)), "engine_finished": finished,
        "well_formed_ids_missing": len(missing), "recorder_dropped": dropped}
    after = await soak.level()
    before = result["level_before"]
    checks["rss_back"] = {"passed": within(before["rss_bytes"], after["rss_bytes"], cfg.tolerance),
                          "before": before["rss_bytes"], "after": after["rss_bytes"],
                          "change": round(after["rss_bytes"] / before["rss_bytes"] - 1, 4)}
    checks["fds_back"] = {"passed": within(before["fds"], after["fds"], cfg.tolerance),
                          "before": before["fds"], "after": after["fds"]}
    result["level_after"] = after
    errors = [f"well-formed {a.status}: {a.error}" for phase in result["answers"] for a in phase if a.error]
    checks["well_formed_served"] = {"passed": not errors, "errors": errors[:20]}
    checks["no_5xx_and_each_bad_input_refused"] = {
        "passed": not tally.problems and not any(s.startswith("5") for s in tally.statuses),
        "problems": tally.problems[:40], "statuses": dict(tally.statuses)}
    p99 = (result["baseline"]["ttft_ms"]["p99"], result["soak"]["ttft_ms"]["p99"])
    ratio = None if None in p99 or not p99[0] else round(p99[1] / p99[0], 3)
    checks["ttft_p99_ratio"] = {"passed": ratio is not None and ratio <= cfg.ttft_ratio, "ratio": ratio,
                                "baseline_ms": p99[0], "soak_ms": p99[1], "limit": cfg.ttft_ratio}
    total = cfg.hostile + cfg.engine_hostile
    checks["load"] = {"passed": tally.sent >= cfg.requests and tally.hostile_peak >= total,
                      "requests": tally.sent, "hostile_connections": sum(tally.hostile.values()),
                      "hostile_peak_at_once": tally.hostile_peak, "bad_inputs": sum(tally.bad.values())}
    killed, nxt = soak.retunes.get("killed") or {}, soak.retunes.get("next") or {}
    # killed while it searched, the retune fails (SearchCrashed); killed just after its search
    # ended, the retune ends normally and the dead process is replaced before the next search
    crashed = killed.get("status") == "failed" and "search process died" in (killed.get("error") or "")
    ended = ("applied", "rejected", "skipped")
    checks["search_process_killed"] = {
        "passed": (crashed or killed.get("status") in ended) and nxt.get("status") in ended,
        "killed_pid": soak.retunes.get("killed_pid"), "search_crashed": crashed,
        "killed_retune": _brief(killed), "next_retune": _brief(nxt)}
    return checks


def _brief(view: dict[str, Any]) -> dict[str, Any]:
    return {k: view.get(k) for k in ("id", "status", "phase", "error") if k in view}


def log_findings(log_path: Path) -> dict[str, Any]:
    """Tracebacks and the warning and error lines (by their JSON `level`) of the daemon's log."""
    text = log_path.read_text(errors="replace")
    levels: Counter = Counter()
    firsts: dict[str, list[str]] = {"warning": [], "error": []}
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            levels["not_json"] += 1
            continue
        level = str(record.get("level", "")).lower() if isinstance(record, dict) else ""
        levels[level] += 1
        if level in ("warning", "error", "critical"):
            said = firsts.setdefault(level, [])
            if len(said) < 10 and record.get("msg") not in said:
                said.append(record.get("msg"))
    return {"lines": sum(levels.values()), "tracebacks": text.count("Traceback (most recent call last)"),
            "levels": dict(levels), "messages": firsts}


def run_soak(cfg: SoakConfig, out: str | None, note: Note | None = None) -> dict[str, Any]:
    """Run the soak (module docstring); print and write its JSON; return it."""
    from bench import print_and_write

    cfg.check()
    note = note or (lambda line: print(line, file=sys.stderr, flush=True))
    with tempfile.TemporaryDirectory(prefix="crossover-soak-", dir=cfg.work_dir) as tmp:
        work = Path(tmp)
        daemon = Daemon(work, cfg)
        note(f"soak: started {' '.join(daemon.argv[2:])} (pid {daemon.proc.pid}); log {daemon.log_path}")
        soak = Soak(cfg, daemon, note)
        started = time.monotonic()

        def interrupted(signum: int, frame: Any) -> None:  # SIGTERM: stop the daemon on the way out
            raise KeyboardInterrupt

        previous = signal.signal(signal.SIGTERM, interrupted)
        try:
            result = asyncio.run(_run_and_audit(soak))
        finally:
            code, stop_s = daemon.stop()
            signal.signal(signal.SIGTERM, previous)
        checks = result.pop("checks")
        checks["clean_exit"] = {"passed": code == 0, "exit_code": code, "seconds": round(stop_s, 1)}
        logs = log_findings(daemon.log_path)
        if out:  # the daemon's log beside the JSON, for whoever reads a failed check
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            logs["copy"] = str(Path(out).with_suffix(".daemon.log"))
            shutil.copyfile(daemon.log_path, logs["copy"])
        checks["no_traceback_in_log"] = {"passed": logs["tracebacks"] == 0, **logs}
        result.pop("answers")
        tally = soak.tally
        summary = {
            "bench": "soak", "ok": all(c["passed"] for c in checks.values()),
            "config": dataclasses.asdict(cfg), "daemon_argv": daemon.argv[3:],
            "wall_s": round(time.monotonic() - started, 1),
            "checks": checks, **result,
            "hostile": dict(tally.hostile), "bad_inputs": dict(tally.bad), "admin": dict(tally.admin),
            "retunes": {k: _brief(v) if isinstance(v, dict) else v for k, v in soak.retunes.items()},
        }
        failed = [name for name, c in checks.items() if not c["passed"]]
        note(f"soak: {'every check passed' if not failed else 'FAILED: ' + ', '.join(failed)}")
        return print_and_write(summary, out)


async def _run_and_audit(soak: Soak) -> dict[str, Any]:
    result = await soak.run()
    timeout = aiohttp.ClientTimeout(total=None, sock_read=300)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(force_close=True)) as session:
        soak.session = session  # force_close: no connection of the audit's stays open for the level
        result["checks"] = await audit(soak, result)
    return result
