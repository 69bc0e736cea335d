"""Trained draft heads: MTP heads, early-exit adapters and the draft vocabulary.

One small safetensors file holds everything the model-based proposers add to
the target (engine/speculation/drafting.py), all trained by `crossover train-heads`
(training/heads.py) on the frozen target:

    vocab            [N] int32     draft vocabulary: token ids, most frequent first
    mtp.{k}.w1       [2d, r]       MTP head k (k = 0..K-1) predicts the token k+1
    mtp.{k}.b1       [r]           places after the one the target just sampled
    mtp.{k}.w2       [r, d]
    exit.{L}.w1/b1/w2 [d, r] ...   exit adapter after the first L layers

Every head and adapter is a residual MLP followed by the target's tied
output embedding restricted to the first n ids of `vocab`. An exit adapter
maps a final-normed hidden state h:

    z = h + silu(h @ w1 + b1) @ w2;  logits = z @ embed[vocab[:n]].T

MTP heads are chained (as in EAGLE and Hydra, but MLPs without attention):
head k also sees the token drafted just before (head 0: the token the target
sampled from h), as its embedding scaled to unit RMS, e(x):

    s_0 = h;  s_{k+1} = s_k + silu([s_k, e(x_k)] @ w1 + b1) @ w2;
    x_{k+1} = argmax s_{k+1} @ embed[vocab[:n]].T

Knowing that token is what a head over h alone (Medusa, w1 [d, r]; such
files still load) has to guess. With w2 = 0 an adapter is a plain early
exit.
Metadata records what training measured (held-out acceptance per head).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from engine.config import ModelConfig
from engine.model.gemma import embedding_rows, table_dtype
from engine.quant.formats import QuantWeight
from engine.quant.matmul import qmatmul

Head = dict[str, jax.Array]  # {"w1": [d, r], "b1": [r], "w2": [r, d]}


def default_heads_path(cfg: ModelConfig) -> Path:
    """Where the shipped heads of a model live (engine/data/heads-<name>.safetensors)."""
    return Path(__file__).parent.parent / "data" / f"heads-{cfg.name}.safetensors"


def apply_head(head: Head, h: jax.Array) -> jax.Array:
    """Residual MLP: h + silu(h @ w1 + b1) @ w2, in h's dtype. h: [..., d]."""
    u = jax.nn.silu(h @ head["w1"] + head["b1"])
    return h + u @ head["w2"]


def token_features(embed: jax.Array, tokens: jax.Array) -> jax.Array:
    """Embedding rows of `tokens` scaled to unit RMS, in embed's dtype: [...] -> [..., d]."""
    e = embedding_rows(embed, tokens).astype(jnp.float32)
    e = e * jax.lax.rsqrt(jnp.mean(e * e, axis=-1, keepdims=True) + 1e-6)
    return e.astype(table_dtype(embed))


def apply_chain_head(head: Head, s: jax.Array, e: jax.Array) -> jax.Array:
    """Chained MTP step: s + silu([s, e] @ w1 + b1) @ w2. s, e: [..., d]."""
    u = jax.nn.silu(jnp.concatenate([s, e], axis=-1) @ head["w1"] + head["b1"])
    return s + u @ head["w2"]


def is_chained(head: Head) -> bool:
    """Whether an MTP head takes [state, token embedding] (w1 twice as tall as w2 is wide)."""
    return head["w1"].shape[0] == 2 * head["w2"].shape[1]


def head_logits(head: Head, h: jax.Array, embed_sub: jax.Array) -> jax.Array:
    """Draft logits over a draft vocabulary: [..., d] -> [..., n] float32."""
    return draft_logits(apply_head(head, h), embed_sub)


def draft_logits(z: jax.Array, embed_sub) -> jax.Array:
    """z [..., d] against a draft vocabulary's embedding rows [n, d] (or the whole tied table as
    a QuantWeight, W [d, vocab]): [..., n] float32."""
    if isinstance(embed_sub, QuantWeight):
        return qmatmul(z, embed_sub)
    return jnp.einsum("...d,vd->...v", z, embed_sub, preferred_element_type=jnp.float32)


def init_head(key: jax.Array, d: int, r: int, dtype=jnp.float32, d_in: int | None = None) -> Head:
    """A fresh head: random w1 [d_in (default d), r], zero w2 (so it starts as the identity)."""
    d_in = d_in or d
    return {
        "w1": (jax.random.normal(key, (d_in, r), jnp.float32) / math.sqrt(d_in)).astype(dtype),
        "b1": jnp.zeros((r,), dtype),
        "w2": jnp.zeros((r, d), dtype),
    }


@dataclass
class DraftHeads:
    """MTP heads, exit adapters and the ranked draft vocabulary of one target."""

    vocab: np.ndarray
    """[N] int32 token ids, most frequent first."""
    mtp: list[Head] = field(default_factory=list)
    """Head k drafts the token k+1 places after the target's newest token."""
    exits: dict[int, Head] = field(default_factory=dict)
    """Exit adapter by the number of target layers it follows."""
    meta: dict = field(default_factory=dict)
    """What training measured (held-out acceptance, data sizes, model name)."""

    def nbytes(self) -> int:
        """Bytes of all heads and adapters (the draft vocabulary embeddings excluded)."""
        leaves = [a for h in (*self.mtp, *self.exits.values()) for a in h.values()]
        return int(sum(np.asarray(a).nbytes for a in leaves)) + int(self.vocab.nbytes)

    @property
    def chained(self) -> bool:
        """Whether the MTP heads are chained (see the module docstring)."""
        return bool(self.mtp) and is_chained(self.mtp[0])

    def head_bytes(self, head: Head) -> int:
        return int(sum(np.asarray(a).nbytes for a in head.values()))

    def astype(self, dtype) -> DraftHeads:
        cast = lambda h: {k: jnp.asarray(v, dtype) for k, v in h.items()}
        return DraftHeads(self.vocab, [cast(h) for h in self.mtp],
                          {L: cast(h) for L, h in self.exits.items()}, dict(self.meta))

    def check(self, cfg: ModelConfig) -> None:
        """Raise ValueError when these heads do not fit the model config."""
        if any(is_chained(h) != self.chained for h in self.mtp):
            raise ValueError("the MTP heads mix chained and unchained heads")
        for name, h in [*((f"mtp.{k}", h) for k, h in enumerate(self.mtp)),
                        *((f"exit.{L}", h) for L, h in self.exits.items())]:
            d_in = 2 * cfg.d_model if name.startswith("mtp") and self.chained else cfg.d_model
            if h["w1"].shape[0] != d_in or h["w2"].shape[1] != cfg.d_model:
                raise ValueError(f"head {name} has w1 {tuple(h['w1'].shape)} and w2 "
                                 f"{tuple(h['w2'].shape)}; the model (d_model={cfg.d_model}) "
                                 f"needs w1 [{d_in}, r] and w2 [r, {cfg.d_model}]")
        for L in self.exits:
            if not 1 <= L < cfg.n_layers:
                raise ValueError(f"exit adapter after {L} layers: the model has {cfg.n_layers}")
        if self.vocab.size and (self.vocab.min() < 0 or self.vocab.max() >= cfg.vocab_size):
            raise ValueError(f"draft vocabulary holds ids outside [0, {cfg.vocab_size})")

    @staticmethod
    def random(cfg: ModelConfig, n_mtp: int, exits: tuple[int, ...], n_vocab: int, seed: int = 0,
               scale: float = 1.0, chained: bool = True) -> DraftHeads:
        """Random (not identity) heads for tests: w2 is random too, times `scale`."""
        key = jax.random.PRNGKey(seed)
        heads = []
        for i in range(n_mtp + len(exits)):
            key, k1, k2 = jax.random.split(key, 3)
            d_in = 2 * cfg.d_model if chained and i < n_mtp else cfg.d_model
            h = init_head(k1, cfg.d_model, cfg.d_model, d_in=d_in)
            h["w2"] = scale * jax.random.normal(k2, h["w2"].shape) / math.sqrt(cfg.d_model)
            heads.append(h)
        vocab = np.random.default_rng(seed).permutation(cfg.vocab_size)[:n_vocab].astype(np.int32)
        return DraftHeads(vocab, heads[:n_mtp], dict(zip(exits, heads[n_mtp:])), {"random": True})

    # -- file format ------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        from safetensors.numpy import save_file

        # float16 on disk (half the bytes of the repository copy); loads cast to the compute dtype
        tensors = {"vocab": np.asarray(self.vocab, np.int32)}
        for k, h in enumerate(self.mtp):
            tensors |= {f"mtp.{k}.{n}": np.asarray(v, np.float16) for n, v in h.items()}
        for L, h in self.exits.items():
            tensors |= {f"exit.{L}.{n}": np.asarray(v, np.float16) for n, v in h.items()}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), metadata={"crossover": json.dumps(self.meta, sort_keys=True)})

    @staticmethod
    def load(path: str | Path, dtype=jnp.float32) -> DraftHeads:
        """Read a heads file; a missing or foreign file raises ValueError naming it."""
        from safetensors import SafetensorError, safe_open

        path = Path(path)
        if not path.is_file():
            raise ValueError(f"draft heads file {path} does not exist "
                             "(make one with `crossover train-heads`)")
        try:
            with safe_open(str(path), framework="numpy") as f:
                names = list(f.keys())
                raw = {n: f.get_tensor(n) for n in names}
                meta = json.loads((f.metadata() or {}).get("crossover", "{}"))
        except (SafetensorError, OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path} is not a crossover heads file (safetensors expected): {exc}") from exc
        if "vocab" not in raw:
            raise ValueError(f"{path} is not a crossover heads file: no 'vocab' tensor")
        groups: dict[tuple[str, int], Head] = {}
        for n, a in raw.items():
            if n == "vocab":
                continue
            kind, idx, leaf = n.split(".")
            groups.setdefault((kind, int(idx)), {})[leaf] = jnp.asarray(a, dtype)
        n_mtp = sum(1 for kind, _ in groups if kind == "mtp")
        mtp = [groups[("mtp", k)] for k in range(n_mtp)]
        exits = {i: h for (kind, i), h in sorted(groups.items()) if kind == "exit"}
        return DraftHeads(raw["vocab"].astype(np.int32), mtp, exits, meta)
