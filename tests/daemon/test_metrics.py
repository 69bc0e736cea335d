"""/metrics: valid Prometheus and OpenMetrics exposition, counters that move with traffic and steps."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

from prometheus_client import generate_latest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from daemon.metrics.sink import REQUEST_HISTOGRAMS, EngineMetrics, request_times
from engine.fake import FakeEngine
from engine.types import RequestResult, StepStats
from store.db import make_engine, session_scope
from store.history import finish_retune, start_retune
from tests.daemon.helpers import MODEL, LiveServer, wait_for

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
OPENMETRICS = "application/openmetrics-text; version=1.0.0"


def parse(text: str, openmetrics: bool = False) -> Samples:
    """Parse an exposition with prometheus_client's parser; check every histogram.

    Returns {(sample name, labels): value}; a sample seen twice fails.
    """
    families = list((openmetrics_families if openmetrics else text_string_to_metric_families)(text))
    samples: Samples = {}
    for family in families:
        for s in family.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in samples, f"duplicate sample {key}"
            samples[key] = s.value
        if family.type == "histogram":
            _check_histogram(family.name, samples)
    return samples


def _check_histogram(name: str, samples: Samples) -> None:
    """Per label set: buckets cumulative and ending at +Inf, `_count` equal to the +Inf bucket."""
    series: dict[frozenset[tuple[str, str]], list[tuple[float, float]]] = {}
    for (n, labels), v in samples.items():
        if n == name + "_bucket":
            le = dict(labels)["le"]
            series.setdefault(labels - {("le", le)}, []).append((float(le), v))
    assert series, name
    for labels, found in series.items():
        buckets = sorted(found)
        counts = [v for _, v in buckets]
        assert buckets[-1][0] == math.inf and counts == sorted(counts), name
        assert samples[(name + "_count", labels)] == counts[-1], name


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def bucket(samples: Samples, name: str, le: float, **labels: str) -> float:
    """The `le` bucket of histogram `name` (prometheus_client writes 2 as "2.0")."""
    found = [v for (n, ls), v in samples.items() if n == name + "_bucket"
             and float(dict(ls)["le"]) == le and ls - {("le", dict(ls)["le"])} == set(labels.items())]
    assert len(found) == 1, (name, le, found)
    return found[0]


def scrape(server: LiveServer) -> Samples:
    r = server.get("/metrics")
    assert r.status == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    return parse(r.data.decode())


def test_metrics_parse_and_count_requests(db_url: str, live: Callable[..., LiveServer]) -> None:
    server = live(db_url=db_url)
    before = scrape(server)
    assert value(before, "crossover_kv_pages_total") == 4096
    assert value(before, "crossover_retunes_total", status="applied") == 0
    assert ("crossover_retunes_total", frozenset({("status", "applied")})) in before
    for prompt in ("abc", "hello"):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 3}
        assert server.post("/v1/completions", body).status == 200
    server.wait_idle()
    after = scrape(server)
    assert value(after, "crossover_requests_total", tenant="default", finish_reason="length") == 2
    assert value(after, "crossover_generation_tokens_total", tenant="default") == 6
    assert value(after, "crossover_prompt_tokens_total", tenant="default") == 4 + 6  # BOS each
    steps = value(after, "crossover_engine_steps_total")
    assert steps >= 3 and value(after, "crossover_batch_size_count") == steps
    assert value(after, "crossover_step_duration_seconds_count") == steps
    assert bucket(after, "crossover_batch_size", math.inf) == steps
    assert ("crossover_spec_decode_num_drafts_total", frozenset()) in after
    assert value(after, "crossover_spec_decode_num_drafts_total") == 0
    assert ("crossover_recorder_dropped_rows_total", frozenset()) in after
    assert value(after, "crossover_recorder_dropped_rows_total") == 0
    assert value(after, "crossover_kv_pages_used") == 0
    assert ("crossover_policy_version", frozenset()) in after
    assert value(after, "crossover_http_requests_in_flight") == 0
    assert value(after, "process_resident_memory_bytes") > 1e6  # the process collector
    assert any(name == "python_info" for name, _ in after)  # the platform collector


def test_openmetrics_when_the_scraper_asks(live: Callable[..., LiveServer]) -> None:
    server = live()
    assert server.post("/v1/completions", {"model": MODEL, "prompt": "abc",
                                           "max_tokens": 2}).status == 200
    server.wait_idle()
    r = server.get("/metrics", {"Accept": f"{OPENMETRICS},text/plain;q=0.5"})
    assert r.status == 200
    assert r.headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
    text = r.data.decode()
    assert text.endswith("# EOF\n")
    samples = parse(text, openmetrics=True)
    assert value(samples, "crossover_requests_total", tenant="default", finish_reason="length") == 1
    assert value(samples, "crossover_generation_tokens_total", tenant="default") == 2
    assert value(samples, "crossover_kv_pages_total") == 4096
    assert value(samples, "crossover_retunes_total", status="applied") == 0  # no database here


def test_retunes_total_reads_the_database(db_url: str, live: Callable[..., LiveServer]) -> None:
    server = live(db_url=db_url)
    engine = make_engine(db_url)
    with session_scope(engine) as s:
        finish_retune(s, start_retune(s, "admin").id, "rejected")
        start_retune(s, "schedule")
    engine.dispose()
    samples = scrape(server)
    assert value(samples, "crossover_retunes_total", status="rejected") == 1
    assert value(samples, "crossover_retunes_total", status="running") == 1


def test_a_database_that_fails_leaves_metrics_up_with_the_last_counts(
        db_url: str, live: Callable[..., LiveServer], monkeypatch) -> None:
    from sqlalchemy.exc import OperationalError

    from daemon.metrics import endpoint

    server = live(db_url=db_url)
    engine = make_engine(db_url)
    with session_scope(engine) as s:
        finish_retune(s, start_retune(s, "admin").id, "rejected")
    engine.dispose()
    samples = scrape(server)
    assert value(samples, "crossover_database_up") == 1
    real = endpoint.retune_counts

    def down(*_a):
        raise OperationalError("SELECT", {}, Exception("unable to open database file"))

    monkeypatch.setattr(endpoint, "retune_counts", down)
    samples = scrape(server)  # 200 (scrape asserts it), not the 500 of an unhandled error
    assert value(samples, "crossover_database_up") == 0
    assert value(samples, "crossover_retunes_total", status="rejected") == 1  # the last read
    monkeypatch.setattr(endpoint, "retune_counts", real)
    assert value(scrape(server), "crossover_database_up") == 1


def test_tenant_names_show_only_to_the_admin_token(db_url: str, live: Callable[..., LiveServer],
                                                   capsys) -> None:
    """Anyone who reaches the port sees each tenant's traffic under a pseudonym; the admin
    token's scrape sees the names."""
    from daemon.metrics.endpoint import pseudonym
    from tests.daemon.tenants.helpers import add_tenant, complete

    server = live(db_url=db_url, open_mode=False, admin_token="adm")
    key = add_tenant(db_url, "acme-corp", capsys=capsys)
    assert complete(server, key)[0] == 200
    server.wait_idle()
    anyone = server.get("/metrics").data.decode()
    assert "acme-corp" not in anyone
    assert value(parse(anyone), "crossover_requests_total", tenant=pseudonym("acme-corp"),
                 finish_reason="stop") == 1
    admin = server.get("/metrics", {"Authorization": "Bearer adm"}).data.decode()
    assert value(parse(admin), "crossover_requests_total", tenant="acme-corp", finish_reason="stop") == 1
    assert "acme-corp" not in server.get("/metrics", {"Authorization": "Bearer wrong"}).data.decode()


def test_spec_decode_counters_follow_step_stats() -> None:
    metrics = EngineMetrics()
    for depth, proposed, accepted, per_pos in [(3, 12, 7, (4, 2, 1)), (2, 4, 3, (2, 1)),
                                               (0, 0, 0, ())]:
        metrics.on_step(StepStats(1, 0.0, 4, 0, 4 + accepted, "ngram" if depth else "none", depth,
                                  proposed, accepted, per_pos, 0.1, 1.0, 12.0, 10, 90, 0, 1))
    metrics.on_result(RequestResult("r1", 'te"am', 5, 9, 0.0, 0.1, 0.2, "stop"))
    text = generate_latest(metrics.registry).decode()
    assert 'tenant="te\\"am"' in text  # label values are escaped on the way out
    samples = parse(text)
    spec = "crossover_spec_decode_"
    assert value(samples, spec + "num_drafts_total") == 4 + 2
    assert value(samples, spec + "num_draft_tokens_total") == 16
    assert value(samples, spec + "num_accepted_tokens_total") == 10
    positions = [value(samples, spec + "num_accepted_tokens_per_pos_total", position=str(i))
                 for i in range(3)]
    assert positions == [6, 3, 1]
    assert value(samples, "crossover_engine_steps_total") == 3
    assert bucket(samples, "crossover_step_duration_seconds", 0.01) == 0
    assert bucket(samples, "crossover_step_duration_seconds", 0.02) == 3
    assert math.isclose(value(samples, "crossover_step_duration_seconds_sum"), 3 * 0.012)
    assert bucket(samples, "crossover_batch_size", 2) == 0
    assert bucket(samples, "crossover_batch_size", 4) == 3
    assert value(samples, "crossover_requests_total", tenant='te"am', finish_reason="stop") == 1
    assert value(samples, "crossover_prompt_tokens_total", tenant='te"am') == 5
    assert value(samples, "crossover_generation_tokens_total", tenant='te"am') == 9


def test_apps_keep_separate_registries() -> None:
    first, second = EngineMetrics(), EngineMetrics()
    first.on_result(RequestResult("r1", "a", 1, 2, 0.0, 0.1, 0.2, "stop"))
    assert value(parse(generate_latest(first.registry).decode()), "crossover_requests_total",
                 tenant="a", finish_reason="stop") == 1
    assert value(parse(generate_latest(second.registry).decode()), "crossover_requests_total",
                 tenant="a", finish_reason="stop") == 0


LATENCY = {"e2e": "crossover_e2e_request_latency_seconds",
           "ttft": "crossover_time_to_first_token_seconds",
           "tpot": "crossover_time_per_output_token_seconds",
           "queue": "crossover_request_queue_time_seconds"}
"""request_times key -> the histogram /metrics shows it in."""
BOUNDS = {key: bounds for key, _, _, bounds in REQUEST_HISTOGRAMS}


def post_all(server: LiveServer, bodies: list[dict]) -> list[int]:
    """POST every body to /v1/completions at once (one thread each); their statuses."""
    statuses: list[int] = [0] * len(bodies)

    def one(i: int) -> None:
        statuses[i] = server.post("/v1/completions", bodies[i]).status

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return statuses


def test_request_histograms_follow_the_requests(live: Callable[..., LiveServer]) -> None:
    # One sequence at a time, 20 ms a step: the requests queue behind each other.
    server = live(engine=FakeEngine(max_batch=1, step_delay_s=0.02))
    before = scrape(server)
    for name in LATENCY.values():  # the series exist, empty, before any request
        assert (name + "_count", frozenset({("model_name", MODEL)})) in before
        assert value(before, name + "_count", model_name=MODEL) == 0
    start = time.time()
    bodies = [{"model": MODEL, "prompt": p, "max_tokens": m}
              for p, m in (("abc", 3), ("hello", 8), ("x", 1), ("wxyz", 2))]
    assert post_all(server, bodies) == [200] * 4
    elapsed = time.time() - start
    server.wait_idle()
    samples = scrape(server)
    results = server.sink.results  # the same RequestResults the metrics sink saw
    assert len(results) == 4
    # By prompt size (BOS + bytes): "x" 1 token (length), "abc" 3 (length), "wxyz" 2 (length),
    # "hello" 6 ("olleh", then EOS).
    assert [r.output_tokens for r in sorted(results, key=lambda r: r.prompt_tokens)] == [1, 3, 2, 6]
    times = [request_times(r) for r in results]
    for key, name in LATENCY.items():
        observed = [t[key] for t in times if key in t]
        assert value(samples, name + "_count", model_name=MODEL) == len(observed), key
        assert math.isclose(value(samples, name + "_sum", model_name=MODEL), sum(observed),
                            rel_tol=1e-9, abs_tol=1e-12), key
        for le in BOUNDS[key]:
            assert bucket(samples, name, le, model_name=MODEL) == sum(v <= le for v in observed)
    assert len([t for t in times if "tpot" in t]) == 3  # not "x": one token has no interval
    for t in times:
        assert 0 <= t["queue"] <= t["ttft"] <= t["e2e"] <= elapsed
    # The last one served waited while the others ran: 6 steps at the least (1 + 3 + 2).
    assert max(t["queue"] for t in times) >= 0.08
    assert value(samples, "crossover_num_preemptions_total", model_name=MODEL) == 0


def test_kv_cache_usage_is_a_fraction_that_moves(live: Callable[..., LiveServer]) -> None:
    server = live(engine=FakeEngine(num_pages=64, page_size=16, step_delay_s=0.05))

    def usage() -> float:
        return value(scrape(server), "crossover_kv_cache_usage_perc", model_name=MODEL)

    assert usage() == 0
    # "abcdefg": BOS + 7 bytes; with max_tokens 56 it holds ceil(64 / 16) = 4 of the 64 pages
    # for the 8 steps it runs (7 letters, then EOS).
    thread = threading.Thread(target=post_all, args=(
        server, [{"model": MODEL, "prompt": "abcdefg", "max_tokens": 56}]))
    thread.start()
    seen: list[float] = []
    wait_for(lambda: seen.append(usage()) or seen[-1] > 0, what="KV usage above zero")
    assert seen[-1] == 4 / 64 and all(0 <= u <= 1 for u in seen)
    thread.join(10)
    server.wait_idle()
    assert usage() == 0


def test_preemptions_and_model_label_follow_step_stats() -> None:
    metrics = EngineMetrics(model_name="gemma")
    text = generate_latest(metrics.registry).decode()
    assert 'crossover_num_preemptions_total{model_name="gemma"} 0.0' in text
    metrics.on_step(StepStats(batch_size=4, preempted=2))
    metrics.on_step(StepStats(batch_size=4, preempted=1))
    metrics.on_result(RequestResult("r1", "t", 5, 1, 10.0, 10.5, 11.0, "length",
                                    scheduled_time=10.25))
    metrics.on_result(RequestResult("r2", "t", 5, 0, 10.0, None, 12.0, "abort"))  # never ran
    samples = parse(generate_latest(metrics.registry).decode())
    assert value(samples, "crossover_num_preemptions_total", model_name="gemma") == 3
    assert value(samples, LATENCY["e2e"] + "_count", model_name="gemma") == 2
    assert value(samples, LATENCY["e2e"] + "_sum", model_name="gemma") == 1.0 + 2.0
    assert value(samples, LATENCY["ttft"] + "_sum", model_name="gemma") == 0.5
    assert value(samples, LATENCY["tpot"] + "_count", model_name="gemma") == 0  # one token only
    assert value(samples, LATENCY["queue"] + "_count", model_name="gemma") == 1
    assert bucket(samples, LATENCY["queue"], 0.2, model_name="gemma") == 0
    assert bucket(samples, LATENCY["queue"], 0.3, model_name="gemma") == 1
    # vLLM's bounds: e2e 1.0 lands in le=1.0, 2.0 in le=2.0; ttft 0.5 in le=0.5
    assert bucket(samples, LATENCY["e2e"], 0.8, model_name="gemma") == 0
    assert bucket(samples, LATENCY["e2e"], 1.0, model_name="gemma") == 1
    assert bucket(samples, LATENCY["e2e"], 2.0, model_name="gemma") == 2
    assert bucket(samples, LATENCY["ttft"], 0.25, model_name="gemma") == 0
    assert bucket(samples, LATENCY["ttft"], 0.5, model_name="gemma") == 1


def test_real_engine_reports_when_a_request_first_ran() -> None:
    """EngineCore (the tiny model): scheduled_time is the first step that ran a request; a
    request aborted while it waited has none."""
    import jax

    from engine.runtime.compiles import enable_persistent_cache
    from engine.types import Request, SamplingParams
    from tests.engine.conftest import make_engine
    from tests.engine.tiny import init_random_params, tiny_config

    enable_persistent_cache()  # as the engine tests do: later runs skip XLA
    cfg = tiny_config()
    engine = make_engine((cfg, init_random_params(cfg, jax.random.PRNGKey(0))), max_batch=1)
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    for i in range(3):  # one sequence at a time: r1 waits for r0, r2 is aborted while it waits
        engine.add_request(Request(f"r{i}", [2, 70, 71, 72], sp))
    results = {r.request_id: r for r in engine.step().finished}  # r0 runs, r1 and r2 wait
    engine.abort("r2")
    while engine.has_work():
        results.update((r.request_id, r) for r in engine.step().finished)
    r0, r1, r2 = results["r0"], results["r1"], results["r2"]
    assert r2.finish_reason == "abort" and r2.scheduled_time is None
    assert r0.arrival_time <= r0.scheduled_time <= r0.first_token_time <= r0.finish_time
    assert r0.finish_time <= r1.scheduled_time <= r1.first_token_time  # it waited for r0
    times = request_times(r1)
    assert times["queue"] == r1.scheduled_time - r1.arrival_time > 0


def test_thread_up_shows_a_worker_that_died(db_url: str, live: Callable[..., LiveServer]) -> None:
    from tuner.config import TunerConfig

    server = live(db_url=db_url, admin_token="T", tuner=TunerConfig(enabled=True, search_process=False))
    admin = {"Authorization": "Bearer T"}
    samples = scrape(server)
    up = {t: value(samples, "crossover_thread_up", thread=t)
          for t in ("engine", "telemetry_recorder", "tuner_scheduler")}
    assert up == {"engine": 1, "telemetry_recorder": 1, "tuner_scheduler": 1}
    assert server.get("/admin/status", admin).json()["threads"] == {
        "engine": True, "telemetry_recorder": True, "tuner_scheduler": True}
    assert server.database is not None
    server.database.recorder.close()  # its thread ends, as an uncaught error would end it
    assert value(scrape(server), "crossover_thread_up", thread="telemetry_recorder") == 0
    assert server.get("/admin/status", admin).json()["threads"]["telemetry_recorder"] is False
