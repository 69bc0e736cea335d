"""`crossover train-heads`: MTP heads and exit adapters by self-distillation.

1. Generate: the frozen target continues workload prompts of every kind
   (copy, code, chat, prose) greedily through the engine itself.
2. Capture: one dense forward per sequence (prompt + continuation) keeps the
   final hidden states, the states after each exit layer, and the target's
   greedy prediction at every position (the labels).
3. Rank the draft vocabulary by token frequency in the stdlib sources plus the
   generated text.
4. Train each head alone with Adam on cross-entropy over the first
   `train_vocab` draft ids: MTP head k at position t learns the target's
   prediction at t+1+k; an exit adapter at t learns the prediction at t.
   Chained MTP heads (engine/speculation/heads.py) train in order, teacher-forced: head
   k reads the state head k-1 left at t and the target's own prediction at
   t+k (the token the chain would have drafted had it been right).
5. Measure held-out top-1 agreement with the target (by prompt, so no held-out
   text was trained on) at each draft vocabulary, and save a safetensors file
   with those figures in its metadata (engine/speculation/heads.py).
6. `crossover train-heads` runs `load_target`, then `train_to_file`: the above,
   then the file is written where the user says, else to the user cache
   (`engine.loader.heads_cache_path`), which the loader prefers over the
   heads shipped in the package; it never writes into the installed package.

Progress goes to a `progress(label, done, total)` callback (engine/runtime/progress.py);
the command line makes it a terminal bar.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from engine.model.gemma import KVView, forward, logits, rms_norm
from engine.runtime.progress import Reporter, Steps, note
from engine.speculation.heads import (
    DraftHeads,
    Head,
    apply_chain_head,
    head_logits,
    init_head,
    token_features,
)


@dataclass(frozen=True)
class TrainConfig:
    """What to generate and how to train."""

    prompts_per_kind: int = 40
    """Workload prompts continued per tenant kind."""
    gen_tokens: int = 96
    """Tokens the target generates per prompt."""
    max_prompt: int = 640
    """Prompts are cut to their last this many tokens."""
    n_mtp: int = 4
    """MTP heads (the deepest drafts position n_mtp)."""
    chained: bool = True
    """Chained MTP heads (each sees the token drafted before it) instead of Medusa heads."""
    exits: tuple[int, ...] = (4, 8)
    """Layer counts after which an exit adapter is trained."""
    train_vocab: int = 8192
    """Softmax width during training (the most frequent draft ids)."""
    keep_vocab: int = 32768
    """Draft vocabulary ids kept in the file (most frequent first)."""
    epochs: int = 3
    batch: int = 512
    lr: float = 2e-3
    holdout: float = 0.1
    """Share of prompts held out for the acceptance figures."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.train_vocab > self.keep_vocab:
            raise ValueError(f"train_vocab={self.train_vocab} exceeds keep_vocab={self.keep_vocab}")
        if not 0.0 < self.holdout < 0.5:
            raise ValueError(f"holdout={self.holdout} must be in (0, 0.5)")


# -- 1. generate --------------------------------------------------------------

def generate_corpus(engine, tc: TrainConfig, progress: Reporter = True) -> list[tuple[str, list[int], int]]:
    """(kind, prompt + continuation ids, prompt length) per prompt, greedy."""
    from bench.workloads import KINDS, prompts, to_request
    from engine.types import Request, SamplingParams

    reqs = []
    for kind in KINDS:
        for i, p in enumerate(prompts(kind, tc.prompts_per_kind, seed=tc.seed + 7919)):
            r = to_request(p, engine.tokenizer, f"{kind}-{i}")
            ids = r.prompt_ids[-tc.max_prompt :]
            reqs.append((kind, Request(r.request_id, ids, SamplingParams(max_tokens=tc.gen_tokens))))
    out = {r.request_id: [] for _, r in reqs}
    for _, r in reqs:
        engine.add_request(r)
    t0 = time.perf_counter()
    with Steps(progress, "train-heads: generating", len(reqs)) as bar:
        while engine.has_work():
            o = engine.step()
            for ev in o.events:
                out[ev.request_id] += ev.token_ids
            if o.finished:
                bar.advance(len(o.finished))
    note(progress, f"train-heads: generated {sum(map(len, out.values()))} tokens for {len(reqs)} prompts "
                   f"in {time.perf_counter() - t0:.0f}s")
    return [(kind, list(r.prompt_ids) + out[r.request_id], len(r.prompt_ids)) for kind, r in reqs]


# -- 2. capture ---------------------------------------------------------------

@partial(jax.jit, static_argnames=("cfg", "capture"))
def _capture(cfg, params, tokens, pos, capture: tuple[int, ...]):
    """Dense forward over one padded sequence [1, T]: final states, exit states (final-normed)."""
    B, _ = tokens.shape

    def empty(kind, idx):
        z = jnp.zeros((B, 0, cfg.n_kv_heads, cfg.head_dim), params["embed"].dtype)
        return KVView(z, z, jnp.zeros((B, 0), jnp.int32))

    h, _, caught = forward(cfg, params, tokens, pos, empty, capture)
    exits = tuple(rms_norm(x, params["final_norm"], cfg.rms_eps)[0] for x in caught)
    return h[0], exits


@jax.jit
def _greedy(params, h):
    return jnp.argmax(logits(params, h), axis=-1).astype(jnp.int32)


def capture(engine, corpus, exits: tuple[int, ...], progress: Reporter = True):
    """Per sequence: (final states [T, d], {L: exit states [T, d]}, target predictions [T])."""
    cfg, params = engine.cfg, engine.runner.params
    out = []
    bar = Steps(progress, "train-heads: capturing hidden states", len(corpus))
    for _, ids, _ in corpus:
        T = len(ids)
        Tp = 256 * -(-T // 256)
        tok = np.zeros((1, Tp), np.int32)
        tok[0, :T] = ids
        pos = np.where(np.arange(Tp) < T, np.arange(Tp), -1).astype(np.int32)[None]
        h, xs = _capture(cfg, params, tok, pos, tuple(L - 1 for L in exits))
        pred = np.concatenate([np.asarray(_greedy(params, h[i : i + 256])) for i in range(0, Tp, 256)])[:T]
        out.append((np.asarray(h[:T], np.float32),
                    {L: np.asarray(x[:T], np.float32) for L, x in zip(exits, xs)},
                    pred))
        bar.advance()
    bar.close()
    return out


def _cached_data(engine, tc: TrainConfig, progress: Reporter):
    """Generated corpus and captured states, kept on disk per model and data settings.

    Steps 1-2 take most of the time; retraining with other epochs or learning
    rates reuses them. The cache lives in the user cache (engine.model.gguf_file.cache_dir).
    """
    import hashlib
    import json

    from engine.model.gguf_file import cache_dir

    key = json.dumps([engine.cfg.name, tc.prompts_per_kind, tc.gen_tokens, tc.max_prompt, list(tc.exits),
                      tc.seed])
    root = cache_dir()
    path = root / f"train-heads-{hashlib.sha256(key.encode()).hexdigest()[:12]}.npz"
    if path.is_file():
        note(progress, f"train-heads: reusing generated text and hidden states from {path}")
        z = np.load(path)
        n = int(z["n"])
        corpus = [(str(z[f"kind{i}"]), z[f"ids{i}"].tolist(), int(z[f"np{i}"])) for i in range(n)]
        caps = [(z[f"h{i}"], {L: z[f"x{L}_{i}"] for L in tc.exits}, z[f"pred{i}"]) for i in range(n)]
        return corpus, caps
    corpus = generate_corpus(engine, tc, progress)
    caps = capture(engine, corpus, tc.exits, progress)
    arrays = {"n": np.asarray(len(corpus))}
    for i, ((kind, ids, n_prompt), (h, xs, pred)) in enumerate(zip(corpus, caps)):
        arrays |= {f"kind{i}": np.asarray(kind), f"ids{i}": np.asarray(ids, np.int32),
                   f"np{i}": np.asarray(n_prompt),
                   f"h{i}": h, f"pred{i}": pred, **{f"x{L}_{i}": x for L, x in xs.items()}}
    root.mkdir(parents=True, exist_ok=True)
    np.savez(path, **arrays)
    return corpus, caps


# -- 3. draft vocabulary ----------------------------------------------------------

def rank_vocab(tokenizer, corpus, vocab_size: int, keep: int) -> np.ndarray:
    """Token ids by frequency in the stdlib sources and the corpus (ties: lower id first)."""
    from bench.workloads.sources import load_modules

    counts = np.zeros(vocab_size, np.int64)
    for mod in load_modules():
        np.add.at(counts, np.asarray(tokenizer.encode(mod.text, add_bos=False), np.int64), 1)
    for _, ids, _ in corpus:
        np.add.at(counts, np.asarray(ids, np.int64), 4)  # generated text weighs more
    order = np.lexsort((np.arange(vocab_size), -counts))
    return order[:keep].astype(np.int32)


# -- 4. train -----------------------------------------------------------------------

def _logits(head: Head, x, f, emb):
    """A head's logits over emb's rows; f: the chained heads' token features (None: unchained)."""
    if f is None:
        return head_logits(head, x, emb)
    return jnp.einsum("nd,vd->nv", apply_chain_head(head, x, f), emb, preferred_element_type=jnp.float32)


def _loss(head: Head, x, f, y, emb):
    lg = _logits(head, x, f, emb)
    lp = jax.nn.log_softmax(lg, axis=-1)
    ok = y >= 0
    nll = -jnp.take_along_axis(lp, jnp.maximum(y, 0)[:, None], axis=1)[:, 0]
    return jnp.sum(jnp.where(ok, nll, 0.0)) / jnp.maximum(jnp.sum(ok), 1)


@jax.jit
def _adam_step(head: Head, m, v, t, x, f, y, emb, lr):
    loss, g = jax.value_and_grad(_loss)(head, x, f, y, emb)
    b1, b2 = 0.9, 0.999
    m = jax.tree.map(lambda a, b: b1 * a + (1 - b1) * b, m, g)
    v = jax.tree.map(lambda a, b: b2 * a + (1 - b2) * b * b, v, g)
    mhat = jax.tree.map(lambda a: a / (1 - b1**t), m)
    vhat = jax.tree.map(lambda a: a / (1 - b2**t), v)
    head = jax.tree.map(lambda p, a, b: p - lr * a / (jnp.sqrt(b) + 1e-8), head, mhat, vhat)
    return head, m, v, loss


@jax.jit
def _top1(head: Head, x, f, emb, ids):
    return ids[jnp.argmax(_logits(head, x, f, emb), axis=-1)]


@jax.jit
def _chain_step(head: Head, s, f):
    return apply_chain_head(head, s, f)


_token_features = jax.jit(token_features)
CHUNK = 512
"""Rows per call of the jitted helpers below: one compiled shape whatever a sequence's length."""


def _features(embed, tokens: np.ndarray) -> np.ndarray:
    """heads.token_features (what the proposer computes) of `tokens`, as float32 numpy."""
    out = []
    for j in range(0, len(tokens), CHUNK):
        part = np.zeros(CHUNK, np.int32)
        part[: len(tokens[j : j + CHUNK])] = tokens[j : j + CHUNK]
        out.append(np.asarray(_token_features(embed, part), np.float32))
    return np.concatenate(out)[: len(tokens)] if out else np.zeros((0, embed.shape[1]), np.float32)


def train_one(x: np.ndarray, y: np.ndarray, emb, tc: TrainConfig, key, label: str, progress: Reporter,
              f: np.ndarray | None = None) -> Head:
    """Adam on one head: x [N, d] inputs, y [N] indices into emb (-1: outside the softmax);
    f [N, d]: token features of a chained head."""
    d = x.shape[1]
    head = init_head(key, d, d, d_in=2 * d if f is not None else d)
    m = jax.tree.map(jnp.zeros_like, head)
    v = jax.tree.map(jnp.zeros_like, head)
    rng = np.random.default_rng(tc.seed)
    steps = tc.epochs * max(1, len(x) // tc.batch)
    t0, t, loss = time.perf_counter(), 0, None
    bar = Steps(progress, f"train-heads: {label}", steps)
    for _ in range(tc.epochs):
        order = rng.permutation(len(x))
        for i in range(0, len(x) - tc.batch + 1, tc.batch):
            idx = order[i : i + tc.batch]
            t += 1
            lr = tc.lr * min(1.0, t / 50) * 0.5 * (1 + np.cos(np.pi * t / steps))
            head, m, v, loss = _adam_step(head, m, v, t, x[idx], None if f is None else f[idx],
                                          y[idx], emb, lr)
            bar.advance()
    bar.close()
    if loss is not None:
        note(progress, f"train-heads: {label}: {t} steps, last loss {float(loss):.3f}, "
                       f"{time.perf_counter() - t0:.0f}s")
    return head


def _pairs(caps, idx, shift: int, which):
    """Inputs at t and the target's prediction at t + shift, over the sequences in idx."""
    xs, ys = [], []
    for i in idx:
        h, ex, pred = caps[i]
        x = h if which is None else ex[which]
        n = len(pred) - shift
        if n > 0:
            xs.append(x[:n])
            ys.append(pred[shift:])
    return np.concatenate(xs), np.concatenate(ys)


def _chain_pairs(states, caps, idx, k: int, embed):
    """Chained head k: (states [N, d], token features [N, d], labels [N]) over the sequences
    in idx; states[i] holds the chain's state at positions 0..T-k-1 of sequence i."""
    xs, fs, ys = [], [], []
    for i in idx:
        pred = caps[i][2]
        n = len(pred) - k - 1
        if n > 0:
            xs.append(states[i][:n])
            fs.append(_features(embed, pred[k : k + n]))
            ys.append(pred[k + 1 : k + 1 + n])
    return np.concatenate(xs), np.concatenate(fs), np.concatenate(ys)


def _advance(states, caps, head: Head, k: int, embed) -> None:
    """Move every chain state past head k (teacher-forced with the target's predictions)."""
    for i, s in states.items():
        pred = caps[i][2]
        n = len(pred) - k - 1
        if n <= 0:
            states[i] = s[:0]
            continue
        f = _features(embed, pred[k : k + n])
        out = []
        for j in range(0, n, CHUNK):
            m = min(CHUNK, n - j)
            sj, fj = np.zeros((CHUNK, s.shape[1]), np.float32), np.zeros((CHUNK, s.shape[1]), np.float32)
            sj[:m], fj[:m] = s[j : j + m], f[j : j + m]
            out.append(np.asarray(_chain_step(head, sj, fj))[:m])
        states[i] = np.concatenate(out)


def _to_sub(y: np.ndarray, vocab: np.ndarray, n: int) -> np.ndarray:
    lookup = np.full(max(int(vocab.max()), int(y.max())) + 1, -1, np.int32)
    lookup[vocab[:n]] = np.arange(n, dtype=np.int32)
    return lookup[y]


def train_heads(engine, tc: TrainConfig = TrainConfig(), progress: Reporter = True) -> DraftHeads:
    """The whole pipeline on a loaded (warmed-up) engine; see the module docstring."""
    t_start = time.perf_counter()
    corpus, caps = _cached_data(engine, tc, progress)
    vocab = rank_vocab(engine.tokenizer, corpus, engine.cfg.vocab_size, tc.keep_vocab)
    rng = np.random.default_rng(tc.seed)
    order = rng.permutation(len(corpus))
    n_hold = max(1, int(len(corpus) * tc.holdout))
    held, train = order[:n_hold], order[n_hold:]
    embed = engine.runner.params["embed"]
    emb_train = jnp.take(embed, jnp.asarray(vocab[: tc.train_vocab]), axis=0)
    key = jax.random.PRNGKey(tc.seed)
    jobs = [("mtp", k, k + 1, None) for k in range(tc.n_mtp)] + [("exit", L, 0, L) for L in tc.exits]
    heads: dict[tuple[str, int], Head] = {}
    acceptance: dict[str, dict[str, float]] = {}
    states = {int(i): caps[i][0] for i in order} if tc.chained else {}
    for kind, idx, shift, which in jobs:
        key, sub = jax.random.split(key)
        label = f"{kind} {'head ' + str(idx) if kind == 'mtp' else 'after ' + str(idx) + ' layers'}"
        chain = tc.chained and kind == "mtp"
        if chain:
            x, f, y = _chain_pairs(states, caps, train, idx, embed)
            xh, fh, yh = _chain_pairs(states, caps, held, idx, embed)
        else:
            (x, y), f = _pairs(caps, train, shift, which), None
            (xh, yh), fh = _pairs(caps, held, shift, which), None
        heads[(kind, idx)] = train_one(x, _to_sub(y, vocab, tc.train_vocab), emb_train, tc, sub, label,
                                       progress, f)
        del x, f, y
        acceptance[f"{kind}.{idx}"] = _heldout(heads[(kind, idx)], xh, yh, embed, vocab, fh)
        if chain and idx + 1 < tc.n_mtp:
            _advance(states, caps, heads[(kind, idx)], idx, embed)
        note(progress, f"train-heads: {label}: held-out agreement with the target "
                       f"{acceptance[f'{kind}.{idx}']}")
    meta = {
        "model": engine.cfg.name, "train_config": asdict(tc),
        "sequences": len(corpus), "heldout_sequences": int(n_hold),
        "tokens": int(sum(len(ids) for _, ids, _ in corpus)),
        "generated_tokens": int(sum(len(ids) - n for _, ids, n in corpus)),
        "heldout_agreement": acceptance, "minutes": round((time.perf_counter() - t_start) / 60, 1),
    }
    out = DraftHeads(vocab, [heads[("mtp", k)] for k in range(tc.n_mtp)],
                     {L: heads[("exit", L)] for L in tc.exits}, meta)
    out.meta["bytes"] = out.nbytes()
    return out


def _heldout(head: Head, x: np.ndarray, y: np.ndarray, embed, vocab: np.ndarray,
             f: np.ndarray | None = None) -> dict[str, float]:
    """Top-1 agreement with the target's prediction at each draft vocabulary size (chained heads:
    given the right earlier tokens, i.e. the conditional acceptance of their position)."""
    res = {}
    for n in (8192, 32768, 0):
        if n > len(vocab):
            continue
        ids = jnp.arange(embed.shape[0], dtype=jnp.int32) if n == 0 else jnp.asarray(vocab[:n])
        emb = embed if n == 0 else jnp.take(embed, ids, axis=0)
        got = np.concatenate([np.asarray(_top1(head, x[i : i + 256], None if f is None else f[i : i + 256],
                                               emb, ids)) for i in range(0, len(x), 256)])
        res[str(n or "full")] = round(float((got == y).mean()), 4)
    return res


def output_path(out: str | Path | None, model_name: str) -> Path:
    """Where `crossover train-heads` writes: `out` when the user names it, else the user cache's
    file for the model (`engine.loader.heads_cache_path`), which the loader looks at first."""
    from engine.loader import heads_cache_path

    return Path(out).expanduser() if out else heads_cache_path(model_name)


def load_target(model: str | None, exits: tuple[int, ...], progress: Reporter = True):
    """The frozen target as an engine for training (float32, no speculation), unwarmed;
    ValueError names a bad model or an exit layer the model does not have."""
    from engine.loader import load_engine

    engine = load_engine(model=model, dtype="float32", max_batch=32, max_context=1024, speculation=False,
                         progress=progress)
    bad = [L for L in exits if not 1 <= L < engine.cfg.n_layers]
    if bad:
        raise ValueError(f"--exits {bad[0]} must be between 1 and {engine.cfg.n_layers - 1} "
                         "(the model's layers - 1)")
    return engine


def train_to_file(engine, tc: TrainConfig, out: str | Path | None = None,
                  progress: Reporter = True) -> tuple[Path, DraftHeads]:
    """Warm the target up, train its heads and save them (`output_path`); returns (path, heads)."""
    path = output_path(out, engine.cfg.name)
    engine.warmup(progress)
    heads = train_heads(engine, tc, progress)
    heads.save(path)
    return path, heads
