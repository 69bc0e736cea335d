"""Soak: the real engine path under mixed, partly hostile traffic; afterwards nothing is lost.

One daemon (loopback only) over EngineCore with the tiny random model, speculation
compiled in (n-gram drafting, verify depths up to 8), a telemetry database, four keyed
tenants, an admin token, and the tuner on with its searches in a spawned process.

1. 200 requests from 8 client threads across the tenants: valid completions and chat
   (streaming or not, greedy or seeded sampling with any 64-bit seed, top-k/top-p, stop
   strings and ids, logprobs, labels, chat without max_tokens), requests with one bad
   field (each must get a 4xx OpenAI error body), clients that hang up mid-stream or
   before the answer, and a few raw sockets that send a streaming request and never read
   (small stream timeouts: they must trip).
2. Meanwhile an admin thread pins random policies (valid ones with pool splits up to the
   maximum; invalid ones, each a 400 `invalid_policy` naming the field) and unpins, and
   once forces a retune whose search process dies (`os._exit`), then runs a retune that
   must end normally: the dead process is replaced.
3. Afterwards, with the stalled sockets still open: nothing in flight, every KV page back
   on the free lists (each once), /health ok with no engine restart, every valid request
   answered in full (and as the engine recorded it), a row in xo_requests for every
   request the engine finished, and /metrics counting the same requests.

`test_speculation_at_the_end_of_the_context_stays_inside_it` is the first fault the soak
found, alone.
"""

from __future__ import annotations

import http.client
import json
import logging
import random
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest
from sqlalchemy import select

from daemon.state import ENGINE_THREAD, STATE
from daemon.tenants.admin_ops import create_tenant
from daemon.tuning import TUNER
from store.db import session_scope
from store.models import Request as RequestRow
from tests.daemon.helpers import RCVBUF, SmallBufferServer, http_request, parse_sse, wait_for
from tests.tuner import searches
from tuner.config import TunerConfig
from tuner.process import ProcessSearch

TOKEN = "soak-admin-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
C, CHAT = "/v1/completions", "/v1/chat/completions"
N_REQUESTS = 200
CLIENTS = 8
STALLED_AT = (15, 60, 110, 160)
"""Job numbers that are stalled readers."""
CRASH_AFTER = 100
"""The admin thread forces the search crash once this many jobs have finished."""
"""Receive buffer of a stalled reader (and send buffer of the daemon's sockets): small, so
unread bytes back up after a few kilobytes."""
PROMPTS = [
    "abcabcabcabcabc abc", "the cat sat on the mat. the cat sat on the", "x", "hello there",
    "def f(x):\n    return x\ndef f(x):\n    return", "one two three one two three one two",
]


def tiny_engine(context: int = 512) -> Any:
    """EngineCore over the tiny random model (batch 8) with n-gram speculation compiled at
    verify depths 1, 2, 4 and 8; the daemon warms it up as in production."""
    import jax

    from engine.runtime.compiles import enable_persistent_cache
    from tests.engine.conftest import SPEC_RC, ChatBytes, make_engine
    from tests.engine.tiny import init_random_params, tiny_config

    enable_persistent_cache()
    cfg = tiny_config()
    return make_engine((cfg, init_random_params(cfg, jax.random.PRNGKey(0))), ChatBytes(),
                       max_context=max(128, context), **SPEC_RC)


@pytest.fixture
def soak(db_url: str) -> Iterator[tuple[SmallBufferServer, list[str]]]:
    """The daemon and its four tenants' API keys."""
    tuner = TunerConfig(search_process=True, interval_s=1.0, min_new_steps=10**6, trials=8,
                        validation_s=2.0, validation_min_steps=20, search_timeout_s=240.0)
    server = SmallBufferServer(tiny_engine(), db_url=db_url, open_mode=False, admin_token=TOKEN,
                        tuner=tuner, tenant_max_queued=64, stream_write_timeout_s=0.25,
                        stream_idle_timeout_s=0.25)
    assert server.database is not None
    with session_scope(server.database.engine) as session:
        keys = [create_tenant(session, f"soak-{i}", limits)[1] for i, limits in enumerate(
            [{}, {}, {"max_concurrent": 3, "max_queued": 32}, {"max_concurrent": 8}])]
    server.start(wait_ready=False)
    try:
        wait_for(lambda: server.app[ENGINE_THREAD].ready, 600, "warmup")
        yield server, keys
    finally:
        server.close()


# ---- what the clients send ----------------------------------------------------------------

def max_tokens(rng: random.Random) -> int:
    return rng.randint(1, 40) if rng.random() < 0.8 else rng.randint(41, 300)


def valid_body(rng: random.Random, model: str, stream: bool | None = None) -> tuple[str, dict[str, Any]]:
    """A random request every field of which is in range (prompt + max_tokens within the context)."""
    chat = rng.random() < 0.5
    body: dict[str, Any] = {"model": model}
    if chat:
        system = [{"role": rng.choice(["system", "developer"]), "content": "be brief"}]
        body["messages"] = (system if rng.random() < 0.3 else []) + [
            {"role": "user", "content": rng.choice(PROMPTS)}]
        if rng.random() < 0.85:  # else the default: the room the context leaves
            body[rng.choice(["max_tokens", "max_completion_tokens"])] = max_tokens(rng)
        if rng.random() < 0.2:
            body.update(logprobs=True, top_logprobs=rng.choice([0, 1]))
    else:
        prompt = rng.choice(PROMPTS)
        body["prompt"] = prompt if rng.random() < 0.8 else [2] + [b + 3 for b in prompt.encode()]
        body["max_tokens"] = max_tokens(rng)
        if rng.random() < 0.2:
            body["logprobs"] = rng.choice([True, 0, 1])
    if rng.random() < 0.4:
        body["temperature"] = 0.0
    else:
        body["temperature"] = rng.choice([0.3, 1.0, 2.0, None])
        body["seed"] = rng.choice([-1, -(2**63), 2**64 - 1, 0, rng.randrange(2**63), None])
        body["top_k"] = rng.choice([-1, 0, 1, 5, 256, None])
        body["top_p"] = rng.choice([0.5, 0.9, 1.0, None])
    if rng.random() < 0.3:
        stops = rng.sample(["a", "e", " ", "\n", "th", "ab", "zz"], rng.randint(1, 4))
        body["stop"] = stops[0] if len(stops) == 1 and rng.random() < 0.5 else stops
    if rng.random() < 0.1:
        body["stop_token_ids"] = rng.sample(range(3, 512), rng.randint(1, 3))
    if rng.random() < 0.2:
        body["ignore_eos"] = True
    if rng.random() < 0.1:
        body.update(user="soak-user", metadata={"run": "soak"})
    body["stream"] = rng.random() < 0.5 if stream is None else stream
    if body["stream"] and rng.random() < 0.3:
        body["stream_options"] = {"include_usage": True}
    return (CHAT if chat else C), {k: v for k, v in body.items() if v is not None}


BAD_FIELDS: list[tuple[str, Any, str | None]] = [
    # (field, value, the param the 400 must name; None: any)
    ("temperature", -0.5, "temperature"), ("temperature", 3, "temperature"),
    ("temperature", "hot", "temperature"), ("top_p", 0, "top_p"), ("top_p", 1.5, "top_p"),
    ("top_k", -2, "top_k"), ("top_k", 2.5, "top_k"), ("top_k", 10**6, "top_k"),
    ("seed", 2**64, "seed"), ("seed", -(2**63) - 1, "seed"), ("seed", 1.5, "seed"),
    ("seed", "x", "seed"), ("max_tokens", 0, "max_tokens"), ("max_tokens", -1, "max_tokens"),
    ("max_tokens", 10**9, "max_tokens"), ("max_tokens", "5", "max_tokens"),
    ("stop", [""], "stop"), ("stop", ["a", "b", "c", "d", "e"], "stop"), ("stop", 5, "stop"),
    ("stop", ["s" * 201], "stop"), ("stop_token_ids", [-1], "stop_token_ids"),
    ("stop_token_ids", [10**6], "stop_token_ids"), ("stop_token_ids", "1", "stop_token_ids"),
    ("stream", "yes", "stream"), ("n", 9, "n"), ("best_of", 2, "best_of"),
    ("presence_penalty", 2.5, "presence_penalty"), ("min_p", 1.5, "min_p"),
    ("logit_bias", {"5": 1}, "logit_bias"), ("frobnicate", 1, "frobnicate"),
    ("user", 5, "user"), ("metadata", "x", "metadata"), ("model", "gpt-17", "model"),
    ("model", 7, "model"),
]
BAD_PROMPTS: list[tuple[Any, str]] = [
    ("", "prompt"), ([], "prompt"), ([5, -1], "prompt"), ("x" * 600, "prompt"),
    ([2, 600], "prompt"),  # past the tiny model's vocabulary: the engine's own check refuses it
]
BAD_CHAT: list[tuple[Any, str]] = [
    ([], "messages"), ([{"role": "wizard", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": "tool", "content": "x"}], "messages[0].tool_call_id"), ("hi", "messages"),
]


def bad_request(rng: random.Random, model: str) -> tuple[str, bytes | dict[str, Any], str | None]:
    """(path, body, the param the error must name) of a request with one bad field."""
    path, body = valid_body(rng, model, stream=rng.random() < 0.5)
    roll = rng.random()
    if roll < 0.1:
        return path, json.dumps(body).encode()[:-3], None  # truncated JSON
    if roll < 0.25 and path == C:
        body["prompt"], param = rng.choice(BAD_PROMPTS)
        return path, body, param
    if roll < 0.25:
        body["messages"], param = rng.choice(BAD_CHAT)
        return path, body, param
    key, value, param = rng.choice(BAD_FIELDS)
    if key == "max_tokens":
        body.pop("max_completion_tokens", None)
    if key == "stream":
        body.pop("stream_options", None)
    body[key] = value
    return path, body, param


# ---- the clients ----------------------------------------------------------------------------

@dataclass
class Outcome:
    kind: str
    """valid, bad, disconnect (mid-stream), hangup (before the answer) or stalled."""
    job: int
    path: str = ""
    body: Any = None
    status: int = 0
    request_id: str | None = None
    finish_reason: str | None = None
    data: bytes = b""
    problems: list[str] = field(default_factory=list)
    sock: socket.socket | None = None


def send(port: int, path: str, body: Any, key: str) -> tuple[int, dict[str, str], bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = http_request(port, "POST", path, data, {"Authorization": f"Bearer {key}"})
    return r.status, r.headers, r.data


def check_answer(out: Outcome) -> None:
    """A full answer: JSON with one choice, or SSE ending with [DONE]; either way one finish
    reason (stop or length), text that holds none of the stop strings (it is cut before the
    first), and no more tokens than max_tokens."""
    body, problems = out.body, out.problems
    if out.status != 200:
        problems.append(f"status {out.status}: {out.data[:300]!r}")
        return
    text_of = (lambda c: c["message"]["content"]) if out.path == CHAT else (lambda c: c["text"])
    if body.get("stream"):
        try:
            events = parse_sse(out.data)
        except (AssertionError, ValueError) as exc:
            problems.append(f"bad SSE framing: {exc}")
            return
        if not events or events[-1] != "[DONE]":
            problems.append("stream did not end with [DONE]")
        chunks = [e for e in events if isinstance(e, dict)]
        if any("error" in e for e in chunks):
            problems.append(f"stream carried an error: {[e for e in chunks if 'error' in e]}")
        choices = [c for e in chunks for c in e.get("choices", [])]
        reasons = [c["finish_reason"] for c in choices if c.get("finish_reason")]
        if len(reasons) != 1:
            problems.append(f"finish reasons in stream: {reasons}")
        out.finish_reason = reasons[0] if reasons else None
        text = "".join(c["text"] if "text" in c else c["delta"].get("content", "") for c in choices)
        ids = {e.get("id") for e in chunks if "id" in e}
        if ids != {out.request_id}:
            problems.append(f"chunk ids {ids} != X-Request-Id {out.request_id}")
        usages = [e["usage"] for e in chunks if e.get("usage")]
        if body.get("stream_options", {}).get("include_usage") and len(usages) != 1:
            problems.append(f"include_usage but usage chunks {usages}")
    else:
        answer = json.loads(out.data)
        choices = answer.get("choices") or []
        if len(choices) != 1 or answer.get("id") != out.request_id:
            problems.append(f"malformed answer: {answer}")
            return
        out.finish_reason, text = choices[0].get("finish_reason"), text_of(choices[0])
        usages = [answer["usage"]]
    if out.finish_reason not in ("stop", "length"):
        problems.append(f"finish_reason {out.finish_reason!r}")
    if not isinstance(text, str):
        problems.append(f"no text: {text!r}")
        return
    stops = [body["stop"]] if isinstance(body.get("stop"), str) else body.get("stop", [])
    if any(stop in text for stop in stops):
        problems.append(f"text {text!r} holds a stop string of {stops}")
    limit = body.get("max_tokens") or body.get("max_completion_tokens")
    if limit is not None and any(not 0 < u["completion_tokens"] <= limit for u in usages):
        problems.append(f"usage {usages} with max_tokens {limit}")


def check_error(out: Outcome, param: str | None) -> None:
    """An OpenAI error body with a 4xx status (never 429: a bad request takes no slot)."""
    if not 400 <= out.status < 500 or out.status == 429:
        out.problems.append(f"bad request got {out.status}: {out.data[:300]!r}")
        return
    try:
        error = json.loads(out.data)["error"]
    except (ValueError, KeyError, TypeError):
        out.problems.append(f"not an error body: {out.data[:300]!r}")
        return
    if not (isinstance(error.get("message"), str) and isinstance(error.get("type"), str)):
        out.problems.append(f"error body lacks message/type: {error}")
    if param is not None and error.get("param") != param:
        out.problems.append(f"error names param {error.get('param')!r}, expected {param!r}: {error}")


def disconnect(port: int, path: str, body: dict[str, Any], key: str, rng: random.Random,
               out: Outcome) -> None:
    """Read the headers and a few bytes of a stream, then hang up."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
        resp = conn.getresponse()
        out.status, out.request_id = resp.status, resp.getheader("X-Request-Id")
        out.data = resp.read(rng.randint(1, 300))
        resp.close()
    finally:
        conn.close()
    if out.status != 200:
        out.problems.append(f"status {out.status} before the hang-up: {out.data[:300]!r}")


def stall(port: int, path: str, body: dict[str, Any], key: str) -> socket.socket:
    """A raw socket that sends one request and then never reads."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)  # before connect: sets the window
    sock.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Authorization: Bearer {key}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def run_job(server: SmallBufferServer, keys: list[str], job: int) -> Outcome:
    rng = random.Random(1000 + job)
    model, key = server.engine.model_name, keys[rng.randrange(len(keys))]
    if job in STALLED_AT:
        # ~150 kB of chunks: more than the socket buffers and aiohttp's 64 KiB take
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True,
                "logprobs": True, "top_logprobs": 1, "ignore_eos": True, "max_tokens": 450}
        return Outcome("stalled", job, CHAT, body, sock=stall(server.port, CHAT, body, key))
    roll = rng.random()
    if roll < 0.2:
        path, body, param = bad_request(rng, model)
        if rng.random() < 0.1:
            key, param = "sk-not-a-key", None  # 401
        out = Outcome("bad", job, path, body)
        out.status, _, out.data = send(server.port, path, body, key)
        check_error(out, param)
        return out
    if roll < 0.25:  # hang up before the answer: the request may or may not reach the engine
        path, body = valid_body(rng, model, stream=False)
        sock = stall(server.port, path, body, key)
        time.sleep(rng.uniform(0.0, 0.05))
        sock.close()
        return Outcome("hangup", job, path, body)
    if roll < 0.35:
        path, body = valid_body(rng, model, stream=True)
        body.update(max_tokens=200, ignore_eos=True)
        body.pop("max_completion_tokens", None)
        out = Outcome("disconnect", job, path, body)
        disconnect(server.port, path, body, key, rng, out)
        return out
    path, body = valid_body(rng, model)
    out = Outcome("valid", job, path, body)
    out.status, headers, out.data = send(server.port, path, body, key)
    out.request_id = headers.get("x-request-id")
    check_answer(out)
    return out


# ---- the admin -------------------------------------------------------------------------------

def valid_pin(rng: random.Random) -> dict[str, Any]:
    bounds = sorted(rng.sample([1, 2, 4, 8, 16, 64], rng.randint(1, 3)))
    rules = []
    for b in bounds:
        depth = rng.choice([0, 1, 2, 3, 4, 5, 8])
        rules.append({"max_batch": b, "technique": "ngram" if depth else "none", "depth": depth})
    return {"rules": rules, "crossover": rng.choice([0, 1, 2, 4, 8, 64]),
            "pool_split": rng.choice([0.0, 0.1, 0.25, 0.5])}


INVALID_PINS: list[tuple[Any, str | None]] = [
    ({"rules": [{"max_batch": 4, "technique": "ngram", "depth": 2.5}]}, "rules[0].depth"),
    ({"rules": [{"max_batch": 1.5}]}, "rules[0].max_batch"),
    ({"rules": [{"max_batch": 64}], "crossover": 1e300}, "crossover"),
    ({"rules": [{"max_batch": 64}], "draft_vocab": -5}, "draft_vocab"),
    ({"rules": [{"max_batch": 4, "technique": "mtp", "depth": 1}, {"max_batch": 64}]}, "rules"),
    ({"rules": [{"max_batch": 4, "technique": "ngram", "depth": 9}]}, "rules[0].depth"),
    ({"rules": [{"max_batch": 8}, {"max_batch": 4}]}, "rules"),
    ({"rules": []}, "rules"),
    ({"rules": [{"max_batch": 64}], "pool_split": 0.9}, "pool_split"),
    ({"rules": [{"max_batch": 64}], "pool_split": 10**400}, "pool_split"),
    ({"rules": [{"max_batch": 64}], "bogus": 1}, "bogus"),
    ({"rules": [{"max_batch": 4, "technique": "none", "depth": 3}]}, "rules[0].depth"),
    (b"[1, 2]", None),
    (b'{"rules": [{"max_batch": 64}], "pool_split": NaN}', None),
]


def wait_retune(server: SmallBufferServer, retune_id: int, timeout: float) -> dict[str, Any]:
    end = time.monotonic() + timeout
    while True:
        view = server.get(f"/admin/retunes/{retune_id}", ADMIN).json()
        if view["status"] != "running" or time.monotonic() > end:
            return view
        time.sleep(0.2)


def wait_searched(server: SmallBufferServer, retune_id: int, timeout: float) -> None:
    """Until the retune's search is over (it ended, or it validates what it applied)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        view = server.get(f"/admin/retunes/{retune_id}", ADMIN).json()
        if view["status"] != "running" or view.get("phase") != "searching":
            return
        time.sleep(0.1)


def crash_then_retune(server: SmallBufferServer, finished: list[Outcome], pin_lock: threading.Lock,
                      problems: list[str], counts: dict[str, Any]) -> None:
    """Once CRASH_AFTER jobs are done: force a retune whose search process dies, then run one
    that must end normally (its search in a new process). Pins wait while either searches
    (a pinned policy would only record a skip); they may land in the validation window."""
    while len(finished) < CRASH_AFTER:
        time.sleep(0.05)
    search = server.app[TUNER]._search
    assert isinstance(search, ProcessSearch), "the daemon should search in a process"
    with pin_lock:
        server.delete("/admin/policy/pin", ADMIN)
        original = search._search
        search._search = searches.crash
        try:
            r = server.post("/admin/retune", None, ADMIN)
            crashed = wait_retune(server, r.json()["retune"]["id"], 240)
        finally:
            search._search = original
        if not (r.json()["started"] and crashed["status"] == "failed"
                and "SearchCrashed" in (crashed["error"] or "")):
            problems.append(f"forced crash: {crashed}")
        r = server.post("/admin/retune", None, ADMIN)
        wait_searched(server, r.json()["retune"]["id"], 300)
    after = wait_retune(server, r.json()["retune"]["id"], 300)
    if not r.json()["started"] or after["status"] not in ("applied", "rejected", "skipped"):
        problems.append(f"retune after the crash: {after}")
    counts["retunes"] = [(v["id"], v["status"], v["error"] or "") for v in (crashed, after)]


def admin_chaos(server: SmallBufferServer, done: threading.Event, pin_lock: threading.Lock,
                problems: list[str], counts: dict[str, Any]) -> None:
    """Random valid and invalid pins and unpins until the traffic is over."""
    rng = random.Random(7)
    while not done.is_set():
        roll = rng.random()
        with pin_lock:
            if roll < 0.4:
                body = valid_pin(rng)
                r = http_request(server.port, "PUT", "/admin/policy/pin", body, ADMIN)
                counts["pins"] += 1
                if r.status != 200 or r.json().get("pinned") is not True:
                    problems.append(f"valid pin {body} -> {r.status} {r.data[:300]!r}")
            elif roll < 0.75:
                body, param = rng.choice(INVALID_PINS)
                r = http_request(server.port, "PUT", "/admin/policy/pin", body, ADMIN)
                counts["invalid_pins"] += 1
                error = r.json().get("error", {}) if r.status == 400 else {}
                if r.status != 400 or (param is not None and (error.get("code"), error.get("param"))
                                       != ("invalid_policy", param)):
                    problems.append(f"invalid pin {body!r} -> {r.status} {r.data[:300]!r}")
            else:
                r = server.delete("/admin/policy/pin", ADMIN)
                counts["unpins"] += 1
                if r.status not in (200, 409):
                    problems.append(f"unpin -> {r.status} {r.data[:300]!r}")
        time.sleep(rng.uniform(0.005, 0.05))


# ---- the test --------------------------------------------------------------------------------

def scrape(server: SmallBufferServer) -> dict[str, float]:
    """Each sample name of /metrics with its values summed over the labels."""
    from bench.soak import scrape as summed

    return summed(server.get("/metrics").data.decode())


def free_lists_whole(engine: Any) -> bool:
    """Every page of both pools on its free list or the prefix cache's list of unheld pages,
    exactly once (none held, none freed twice)."""
    pool = engine.pool
    return all(sorted(a._free + list(a._cached)) == list(range(1, a.num_pages)) and a.num_used == 0
               for a in (pool.global_alloc, pool.local_alloc))


def test_soak(soak: tuple[SmallBufferServer, list[str]], caplog: pytest.LogCaptureFixture) -> None:
    server, keys = soak
    caplog.set_level(logging.WARNING, logger="crossover.api")
    engine, started = server.engine, time.monotonic()
    finished: list[Outcome] = []
    admin_problems: list[str] = []
    counts: dict[str, Any] = {"pins": 0, "invalid_pins": 0, "unpins": 0}
    done, pin_lock = threading.Event(), threading.Lock()
    with ThreadPoolExecutor(2) as admins:
        chaos = admins.submit(admin_chaos, server, done, pin_lock, admin_problems, counts)
        crash = admins.submit(crash_then_retune, server, finished, pin_lock, admin_problems, counts)
        with ThreadPoolExecutor(CLIENTS) as clients:
            futures = [clients.submit(run_job, server, keys, j) for j in range(N_REQUESTS)]
            for f in futures:
                finished.append(f.result(timeout=600))
        crash.result(timeout=900)
        done.set()
        chaos.result(timeout=60)
    outcomes = sorted(finished, key=lambda o: o.job)
    stalled = [o.sock for o in outcomes if o.sock is not None]
    try:
        # the stalled sockets are still open: their requests must have been aborted or finished
        wait_for(lambda: (server.app[STATE].in_flight == 0 and server.app[ENGINE_THREAD].active == 0
                          and engine.pool.used == 0 and not engine.has_work()), 60, "server idle")
        assert free_lists_whole(engine), "KV pages missing from, or twice on, the free lists"
        health = server.get("/health")
        assert health.status == 200 and health.json() == {"status": "ok", "engine_restarts": 0}
        problems = [f"job {o.job} ({o.kind} {o.path} {o.body!r}): {p}"
                    for o in outcomes for p in o.problems] + admin_problems
        assert not problems, "\n".join(problems)

        results = {r.request_id: r for r in list(server.sink.results)}
        valid = [o for o in outcomes if o.kind == "valid"]
        for o in valid:  # the engine's record agrees with what the client got
            assert o.request_id in results, o
            assert results[o.request_id].finish_reason == o.finish_reason, (o, results[o.request_id])
        dropped = [o for o in outcomes if o.kind == "disconnect"]
        assert all(o.request_id in results for o in dropped)
        # the bad requests never reached the engine; each stalled reader's request did (150 kB
        # that nobody reads: the stream timeouts abort it, unless it finishes first), and so
        # did those of the clients that hung up before the answer, unless the daemon saw first
        unnamed = [results[rid] for rid in set(results) - {o.request_id for o in outcomes}]
        hangups = sum(o.kind == "hangup" for o in outcomes)
        assert len(stalled) <= len(unnamed) <= len(stalled) + hangups
        assert {r.finish_reason for r in unnamed} <= {"abort", "length", "stop"}
        trips = [r.crossover_fields["reason"] for r in caplog.records  # type: ignore[attr-defined]
                 if r.getMessage() == "client stopped reading; request aborted"]
        assert 1 <= len(trips) <= len(stalled) + len(dropped), trips
        assert set(trips) <= {"write_timeout", "idle_timeout"}

        def rows() -> list[tuple[str, str]]:
            with session_scope(server.database.engine) as session:
                return list(session.execute(select(RequestRow.request_id, RequestRow.finish_reason)))

        wait_for(lambda: {rid for rid, _ in rows()} >= set(results), 30, "telemetry rows")
        recorded = rows()
        assert len(recorded) == len({rid for rid, _ in recorded}) == len(results)
        assert dict(recorded) == {rid: r.finish_reason for rid, r in results.items()}
        assert engine.compiles_since_warmup() == 0
        metrics = scrape(server)  # /metrics agrees: nothing held, nothing dropped, all counted
        assert metrics["crossover_requests_total"] == len(results)
        assert metrics["crossover_e2e_request_latency_seconds_count"] == len(results)
        assert metrics["crossover_retunes_total"] >= 2
        for name in ("crossover_kv_pages_used", "crossover_kv_cache_usage_perc",
                     "crossover_http_requests_in_flight", "crossover_recorder_dropped_rows_total",
                     "crossover_engine_restarts_total", "crossover_compiles_since_warmup"):
            assert metrics[name] == 0, (name, metrics[name])
    finally:
        for sock in stalled:
            sock.close()
    print(f"soak: {time.monotonic() - started:.0f} s; {len(valid)} valid, {len(dropped)} hung up "
          f"({sum(results[o.request_id].finish_reason == 'abort' for o in dropped)} aborted), "
          f"{sum(o.kind == 'bad' for o in outcomes)} bad, {hangups} hung up early, "
          f"{len(unnamed) - len(stalled)} of them reached the engine; stream timeouts {trips}; "
          f"admin {counts}")


def test_speculation_at_the_end_of_the_context_stays_inside_it() -> None:
    """What the soak first found, alone: a request whose prompt + max_tokens fills the context,
    drafting 8 tokens a step. Near its end the drafts must be cut at the context: a verify
    call reaching past the largest context bucket raised in the forward path, a fault no
    request owns, which failed every request in flight and restarted the engine loop."""
    from engine.policy import BatchRule, TunedPolicy
    from engine.types import Request, SamplingParams

    engine = tiny_engine(context=128)
    engine.set_policy(TunedPolicy(rules=(BatchRule(8, "ngram", 8), BatchRule(64)), crossover=8,
                                  version=1))
    prompt = [2] + [b + 3 for b in b"abcabcabcabcabc abc" * 3]  # the n-gram proposer drafts
    room = engine.max_context - len(prompt)
    engine.add_request(Request("r", prompt, SamplingParams(max_tokens=room, ignore_eos=True)))
    tokens, results, proposed = [], [], 0
    while engine.has_work():
        out = engine.step()
        tokens += [t for e in out.events for t in e.token_ids]
        results += out.finished
        proposed += out.stats.proposed if out.stats else 0
    assert [(r.finish_reason, r.output_tokens) for r in results] == [("length", room)]
    assert len(tokens) == room and proposed > 0
    assert engine.pool.used == 0
