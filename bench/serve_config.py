"""`crossover bench serve`'s configuration: what its flags (cli/commands/bench.py) ask for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_MIX = {"copy": 1.0, "code": 1.0, "chat": 1.0, "prose": 1.0}


@dataclass(frozen=True)
class ServeBenchConfig:
    """What `crossover bench serve` was asked to do."""

    concurrency: int = 8
    """Closed loop: clients, each with one request in flight."""
    requests: int = 64
    """Jobs to send (fewer when --seconds runs out first)."""
    max_tokens: int = 64
    """Output tokens per request (exactly: EOS is ignored)."""
    rate: float | None = None
    """Open loop: Poisson arrivals per second; None is the closed loop."""
    seconds: float | None = None
    """Stop sending new requests after this long."""
    mix: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_MIX))
    """Prompt kind -> weight."""
    seed: int = 0
    """Seed of the prompt draw and of the arrival times."""
    rounds: int = 1
    """Both phases this many times, alternating; each phase reports its fastest round."""
    model: str | None = None
    """A .gguf file or a HF Gemma 3 directory; None: Gemma 3 270M."""
    dtype: str | None = None
    """Compute dtype; None: the backend's default."""
    max_batch: int = 32
    """The engine's most sequences decoded together."""
    max_context: int = 1024
    """The engine's context in tokens; prompts that do not fit with max_tokens are not drawn."""
    fake: bool = False
    """FakeEngine instead of the model (fast; for tests)."""
    fake_step_ms: float = 10.0
    """FakeEngine: sleep per step, standing in for the model's step time."""
    url: str | None = None
    """Bench a running daemon instead of one started here."""
    api_key: str | None = None
    """Bearer key for `url` (never written to the JSON)."""
    admin_token: str | None = None
    """`url`'s admin token: its prefix cache is emptied where the engine here has its own emptied
    (before each HTTP round and the idle phase); without it the daemon keeps its cache. Never
    written to the JSON."""
    db: str | None = None
    """Telemetry database of the in-process daemon; None: a temporary SQLite file."""
    no_db: bool = False
    """Run the in-process daemon without a telemetry database."""
    shared_prefix: bool = False
    """The shared-prefix workload (bench.workloads.shared) instead of --mix."""
    prefix_tokens: int = 1000
    """--shared-prefix: tokens of each tenant's system prompt."""
    prefix_cache: bool = True
    """The engine started here shares KV pages of common prompt prefixes (engine/memory/prefix_cache.py)."""
    speculation: bool = True
    """The engine started here loads the n-gram proposer and serves the policy a new daemon
    starts with (daemon.tuning.starter_policy), in both phases; False: plain decoding only."""
    engine_rates: str | None = None
    """A `crossover bench engine` JSON whose rates the efficiency bound uses (else measured here)."""
    tenant_keys: str | None = None
    """--url: a JSON file {tenant: API key}; a tenant's requests are sent with its key."""
    idle_ttft: bool = True
    """After the rounds, send each served job alone (one token) and compare its TTFT with the
    fastest HTTP round's (`ttft_vs_idle` in the JSON)."""
