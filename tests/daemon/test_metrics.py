"""/metrics: valid Prometheus and OpenMetrics exposition, counters that move with traffic and steps."""

from __future__ import annotations

import math
from collections.abc import Callable

from prometheus_client import generate_latest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from daemon.metrics.sink import EngineMetrics
from engine.types import RequestResult, StepStats
from store.db import make_engine, session_scope
from store.history import finish_retune, start_retune
from tests.daemon.helpers import MODEL, LiveServer

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
    """Buckets cumulative and ending at +Inf, `_count` equal to the +Inf bucket."""
    buckets = sorted((float(dict(labels)["le"]), v) for (n, labels), v in samples.items()
                     if n == name + "_bucket")
    counts = [v for _, v in buckets]
    assert buckets[-1][0] == math.inf and counts == sorted(counts), name
    assert samples[(name + "_count", frozenset())] == counts[-1], name


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def bucket(samples: Samples, name: str, le: float) -> float:
    """The `le` bucket of histogram `name` (prometheus_client writes 2 as "2.0")."""
    found = [v for (n, labels), v in samples.items()
             if n == name + "_bucket" and float(dict(labels)["le"]) == le]
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
