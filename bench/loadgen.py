"""Load for `crossover bench serve`: one list of jobs, sent over HTTP or straight to the engine.

1. `Job`s come from bench.workloads prompts: chat prompts go to
   /v1/chat/completions as messages, the rest to /v1/completions as text;
   every job asks for exactly `max_tokens` tokens (`ignore_eos`), greedy.
2. A schedule says when each job starts: closed loop (`rate` None: N
   clients, each sends its next job when the previous one finished) or open
   loop (job i starts at its Poisson arrival `Job.at_s`, whatever is running).
3. `run_http` streams every job (SSE, `include_usage`) with aiohttp and
   times it: TTFT at the first chunk carrying text, inter-token latencies
   (ITL) between successive chunks carrying text, the last token at the
   chunk carrying finish_reason, the token count from the usage chunk. A job
   whose prompt names a tenant is sent with that tenant's key when `keys`
   has one (else with the run's key).
4. `run_engine` sends the same jobs, as `engine.types.Request`s encoded up
   front (with the prompt's tenant), to `EngineCore.step()` called in a loop
   on this thread: no HTTP, no event loop, no thread hop; TTFT at the first
   event carrying tokens, ITL between successive ones.
5. Both return one `Sample` per job sent and the wall time from the first
   send to the last finish; `bench.serve` summarizes them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.workloads import Prompt, to_request
from engine.types import Request

Progress = Callable[[int], None]
"""Called with the number of jobs finished so far."""


@dataclass(frozen=True)
class Job:
    """One request of the workload."""

    index: int
    prompt: Prompt
    max_tokens: int
    at_s: float = 0.0
    """Open loop: start offset from the beginning of the run (seconds)."""

    def route(self) -> str:
        return "/v1/chat/completions" if self.prompt.chat else "/v1/completions"

    def body(self, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model, "max_tokens": self.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
        }
        if self.prompt.chat:
            body["messages"] = self.prompt.as_messages()
        else:
            body["prompt"] = self.prompt.text
        return body

    def request(self, tokenizer: Any, request_id: str) -> Request:
        """The engine Request the daemon would build from `body()` (same ids, same sampling)."""
        tenant = self.prompt.tenant or "default"  # open mode's tenant unless the prompt names one
        req = to_request(self.prompt, tokenizer, request_id, self.max_tokens, tenant=tenant)
        req.sampling = dataclasses.replace(req.sampling, ignore_eos=True)
        return req


@dataclass
class Sample:
    """What one job measured; times are seconds from its send."""

    index: int
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    last_token_s: float | None = None
    latency_s: float | None = None
    error: str | None = None
    itl_s: list[float] = field(default_factory=list)
    """Inter-token latencies: time between successive chunks (events) that carry tokens."""
    last_text_s: float | None = None
    """The latest chunk (event) that carried tokens."""

    def took_tokens(self, now_s: float) -> None:
        """A chunk (event) with tokens arrived `now_s` after the send: TTFT or one more ITL."""
        if self.ttft_s is None:
            self.ttft_s = now_s
        elif self.last_text_s is not None:
            self.itl_s.append(now_s - self.last_text_s)
        self.last_text_s = now_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (None with fewer than two tokens)."""
        if self.ttft_s is None or self.last_token_s is None or self.output_tokens < 2:
            return None
        return (self.last_token_s - self.ttft_s) / (self.output_tokens - 1)


def make_jobs(prompts: list[Prompt], max_tokens: int, rate: float | None, seed: int) -> list[Job]:
    """Jobs in send order; with `rate` (requests/s) their Poisson arrival offsets."""
    rng = random.Random(f"crossover-bench-serve:{seed}")
    jobs, t = [], 0.0
    for i, p in enumerate(prompts):
        jobs.append(Job(i, p, max_tokens, t if rate else 0.0))
        if rate:
            t += rng.expovariate(rate)
    return jobs


# ---- over HTTP --------------------------------------------------------------
async def run_http(url: str, model: str, jobs: list[Job], concurrency: int, rate: float | None,
                   api_key: str | None = None, deadline_s: float | None = None,
                   progress: Progress | None = None, keys: Mapping[str, str] | None = None
                   ) -> tuple[list[Sample], float]:
    """Send `jobs` to the daemon at `url`; (samples of the jobs sent, wall seconds).

    `keys`: tenant -> API key; a job whose prompt's tenant has one is sent with it.
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    samples: list[Sample] = []

    def done(sample: Sample) -> None:
        samples.append(sample)
        if progress is not None:
            progress(len(samples))

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout,
                                     headers=headers) as session:
        start = time.perf_counter()
        end = None if deadline_s is None else start + deadline_s

        async def one(job: Job) -> None:
            key = (keys or {}).get(job.prompt.tenant)
            auth = {"Authorization": f"Bearer {key}"} if key else None
            done(await _stream_one(session, url.rstrip("/"), model, job, auth))

        if rate is None:
            pending = deque(jobs)

            async def client() -> None:
                while pending and (end is None or time.perf_counter() < end):
                    await one(pending.popleft())

            await asyncio.gather(*(client() for _ in range(concurrency)))
        else:
            tasks = []
            for job in jobs:
                if end is not None and start + job.at_s >= end:
                    break
                await asyncio.sleep(max(0.0, start + job.at_s - time.perf_counter()))
                tasks.append(asyncio.create_task(one(job)))
            await asyncio.gather(*tasks)
        return samples, time.perf_counter() - start


async def _stream_one(session: aiohttp.ClientSession, base: str, model: str, job: Job,
                      headers: dict[str, str] | None = None) -> Sample:
    sample = Sample(job.index)
    sent = time.perf_counter()
    try:
        async with session.post(base + job.route(), json=job.body(model),
                                headers=headers) as response:
            if response.status != 200:
                text = await response.text()
                sample.error = f"HTTP {response.status}: {text[:200]}"
                return sample
            async for chunk in read_sse(response.content):
                _account(sample, chunk, time.perf_counter() - sent)
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:  # bad JSON too
        sample.error = f"{type(exc).__name__}: {exc}"
    sample.latency_s = time.perf_counter() - sent
    if sample.error is None and sample.last_token_s is None:
        sample.error = "the stream ended without a finish_reason"
    return sample


@dataclass(frozen=True)
class SseChunk:
    """What one `data:` event of an OpenAI-style completion stream carries."""

    error: str | None = None
    """The error object's message, when the chunk carries one."""
    usage: dict[str, Any] | None = None
    """The usage object (the last chunk, with `stream_options.include_usage`)."""
    texts: int = 0
    """Choices that carry text (completions' `text` or chat's `delta.content`)."""
    finished: bool = False
    """Some choice carries a finish_reason."""


async def read_sse(lines: AsyncIterable[bytes]) -> AsyncIterator[SseChunk]:
    """The chunks of a streamed completion, one per `data: {...}` line, up to `data: [DONE]`;
    other lines (blank separators, comments) are skipped. Bad JSON raises ValueError."""
    async for line in lines:
        if not line.startswith(b"data: "):
            continue
        payload = line[6:].strip()
        if payload == b"[DONE]":
            return
        chunk = json.loads(payload)
        texts, finished = 0, False
        for choice in chunk.get("choices", ()):
            text = choice.get("text") if "text" in choice else choice.get("delta", {}).get("content")
            texts += bool(text)
            finished = finished or bool(choice.get("finish_reason"))
        error = str(chunk["error"].get("message")) if "error" in chunk else None
        yield SseChunk(error, chunk.get("usage"), texts, finished)


def _account(sample: Sample, chunk: SseChunk, now_s: float) -> None:
    """Add what one streamed chunk says to `sample` (`now_s`: seconds since the send)."""
    if chunk.error is not None:
        sample.error = chunk.error
    if chunk.usage:
        sample.prompt_tokens = chunk.usage["prompt_tokens"]
        sample.output_tokens = chunk.usage["completion_tokens"]
    if chunk.texts:
        sample.took_tokens(now_s)
    if chunk.finished:
        sample.last_token_s = now_s


# ---- straight to the engine -------------------------------------------------
def run_engine(engine: Any, jobs: list[Job], concurrency: int, rate: float | None,
               progress: Progress | None = None, tag: str = "") -> tuple[list[Sample], float]:
    """Step `engine` on this thread through `jobs`; (samples, wall seconds).

    Request ids are "bench-engine-{tag}-{index}".
    """
    requests = [job.request(engine.tokenizer, f"bench-engine-{tag}-{job.index}") for job in jobs]
    samples = {job.index: Sample(job.index, len(r.prompt_ids)) for job, r in zip(jobs, requests)}
    by_id = {r.request_id: job for job, r in zip(jobs, requests)}
    pending = deque(zip(jobs, requests))
    sent: dict[int, float] = {}
    finished = 0
    start = time.perf_counter()

    def send() -> None:
        job, req = pending.popleft()
        sent[job.index] = time.perf_counter()
        engine.add_request(req)

    for _ in range(min(concurrency, len(pending)) if rate is None else 0):
        send()
    while pending or engine.has_work():
        if rate is not None:
            while pending and start + pending[0][0].at_s <= time.perf_counter():
                send()
            if not engine.has_work():
                time.sleep(max(0.0, start + pending[0][0].at_s - time.perf_counter()))
                continue
        out = engine.step()
        now = time.perf_counter()
        for event in out.events:
            job = by_id[event.request_id]
            sample, since = samples[job.index], now - sent[job.index]
            sample.output_tokens += len(event.token_ids)
            if event.token_ids:
                sample.took_tokens(since)
            if event.finished:
                sample.last_token_s = sample.latency_s = since
                finished += 1
                if progress is not None:
                    progress(finished)
                if rate is None and pending:
                    send()
    return [samples[i] for i in sorted(sent)], time.perf_counter() - start


def forget_prefixes(engine: Any) -> None:
    """Empty the prefix cache of an engine a benchmark reuses, before a phase or a policy's run.
    Every phase (bench serve) or run (bench tuner) sends the same prompts, so one after the first
    would find them cached and skip most of their prefill (bench serve's engine-only phase served
    twice the HTTP phase's tokens/s partly from that; every bench tuner policy after the first
    prefilled 6% of the prompt tokens the first one did).
    Only an idle engine's pool may be reset; the fake engine has no pages to forget. A closed
    HTTP stream leaves an abort in the engine's inbox, so the engine steps until it is idle first
    (an abort of a finished request changes nothing else); a reset skipped for it once let the
    engine-only phase find the HTTP phase's prompts cached."""
    pool = getattr(engine, "pool", None)
    if pool is None:
        return
    for _ in range(1000):
        if not engine.has_work():
            pool.reset()
            return
        engine.step()
    raise RuntimeError("the engine still has work after the phase ended; its prefix cache stays")


async def empty_prefix_cache(engine: Any, url: str | None = None, admin_token: str | None = None) -> bool:
    """Empty the prefix cache before a phase whose prompts must not find an earlier phase's
    cached: the engine's here (`forget_prefixes`), or with `url` the daemon's there, through
    its admin API (`reset_remote_prefix_cache`, which needs `admin_token`). Whether it was
    emptied: without a token a daemon at `url` keeps its cache."""
    if url is None:
        forget_prefixes(engine)
        return True
    if not admin_token:
        return False
    await reset_remote_prefix_cache(url, admin_token)
    return True


async def reset_remote_prefix_cache(url: str, admin_token: str) -> dict[str, Any]:
    """POST /admin/reset_prefix_cache to the daemon at `url` (daemon/admin.py): its answer,
    {"dropped_blocks": n, ...}; UserError when it refuses or cannot be reached."""
    from daemon.user_error import UserError

    target = url.rstrip("/") + "/admin/reset_prefix_cache"
    try:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {admin_token}"}) as session:
            async with session.post(target) as response:
                if response.status != 200:
                    raise UserError(f"POST {target}: HTTP {response.status}: {(await response.text())[:200]}")
                return await response.json()
    except (aiohttp.ClientError, OSError) as exc:
        raise UserError(f"cannot reach the daemon at {url}: {exc}") from None
