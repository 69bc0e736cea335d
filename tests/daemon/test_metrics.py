"""/metrics: valid Prometheus text exposition, counters that move with traffic and steps."""

from __future__ import annotations

import math
import re
from collections.abc import Callable

from daemon.exposition import Family, Histogram, histogram_family, render
from daemon.metrics_sink import EngineMetrics
from engine.types import RequestResult, StepStats
from store.db import make_engine, session_scope
from store.history import finish_retune, start_retune
from tests.daemon.daemon_helpers import MODEL, LiveServer

NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\["\\n])*"'
VALUE = r"[-+]?(?:[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?|Inf|NaN)"
SAMPLE = re.compile(rf"({NAME})(?:\{{((?:{LABEL})(?:,{LABEL})*)?\}})? ({VALUE})")
HELP = re.compile(rf"# HELP ({NAME}) .*")
TYPE = re.compile(rf"# TYPE ({NAME}) (counter|gauge|histogram|summary|untyped)")
SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("", "_sum", "_count")}

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """Check every line of an exposition; return {(name, labels): value}."""
    assert text.endswith("\n")
    types: dict[str, str] = {}
    samples: Samples = {}
    for line in text.splitlines():
        if line.startswith("# TYPE"):
            m = TYPE.fullmatch(line)
            assert m and m.group(1) not in types, line
            types[m.group(1)] = m.group(2)
            continue
        if line.startswith("#"):
            assert HELP.fullmatch(line), line
            continue
        m = SAMPLE.fullmatch(line)
        assert m, f"not a valid sample line: {line!r}"
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        assert _family(name, types), f"sample {name} has no TYPE line before it"
        pairs = frozenset(tuple(p.split("=", 1)) for p in re.findall(LABEL, labels))
        key = (name, frozenset((k, v.strip('"')) for k, v in pairs))
        assert key not in samples, f"duplicate sample {line!r}"
        samples[key] = float(value.replace("Inf", "inf"))
    _check_histograms(types, samples)
    return samples


def _family(name: str, types: dict[str, str]) -> str | None:
    if name in types:
        return name
    for fam, kind in types.items():
        if any(name == fam + s for s in SUFFIXES.get(kind, ())):
            return fam
    return None


def _check_histograms(types: dict[str, str], samples: Samples) -> None:
    for fam, kind in types.items():
        if kind != "histogram":
            continue
        buckets = sorted((float(dict(lbl)["le"].replace("+Inf", "inf")), v)
                         for (n, lbl), v in samples.items() if n == fam + "_bucket")
        counts = [v for _, v in buckets]
        assert buckets[-1][0] == math.inf and counts == sorted(counts), fam
        assert samples[(fam + "_count", frozenset())] == counts[-1]


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def scrape(server: LiveServer) -> Samples:
    r = server.get("/metrics")
    assert r.status == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    return parse(r.data.decode())


def test_metrics_parse_and_count_requests(db_url: str, live: Callable[..., LiveServer]) -> None:
    server = live(db_url=db_url)
    before = scrape(server)
    assert value(before, "crossover_kv_pages_total") == 4096
    assert value(before, "crossover_retunes_total", status="applied") == 0
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
    assert value(after, "crossover_spec_decode_num_drafts_total") == 0
    assert value(after, "crossover_recorder_dropped_rows_total") == 0
    assert value(after, "crossover_kv_pages_used") == 0
    assert value(after, "crossover_policy_version") == 0


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
    samples = parse(render(metrics.families()))
    spec = "crossover_spec_decode_"
    assert value(samples, spec + "num_drafts_total") == 4 + 2
    assert value(samples, spec + "num_draft_tokens_total") == 16
    assert value(samples, spec + "num_accepted_tokens_total") == 10
    positions = [value(samples, spec + "num_accepted_tokens_per_pos_total", position=str(i))
                 for i in range(3)]
    assert positions == [6, 3, 1]
    assert value(samples, "crossover_step_duration_seconds_bucket", le="0.02") == 3
    assert value(samples, "crossover_batch_size_bucket", le="2") == 0
    assert value(samples, "crossover_requests_total", tenant='te\\"am', finish_reason="stop") == 1


def test_exposition_escapes_and_renders_histograms() -> None:
    hist = Histogram((1, 2.5))
    for v in (0.5, 1, 2, 7):
        hist.observe(v)
    fam = Family("x_total", "counter", "Back\\slash and\nnewline.")
    fam.add(3, {"l": 'a"b\\c\nd'})
    text = render([fam, histogram_family("h", "A histogram.", hist.snapshot())])
    assert 'x_total{l="a\\"b\\\\c\\nd"} 3\n' in text
    assert "# HELP x_total Back\\\\slash and\\nnewline.\n" in text
    assert 'h_bucket{le="1"} 2\nh_bucket{le="2.5"} 3\nh_bucket{le="+Inf"} 4\nh_sum 10.5\n' in text
    parse(text)
