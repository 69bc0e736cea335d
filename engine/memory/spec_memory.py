"""What each speculative technique costs in accelerator memory (stdlib only).

`crossover plan` prints these next to the tenants they displace; the tuner's
capacity constraint uses the loaded proposers' own `resident_bytes()`, which a
test checks against these formulas for the default model.

Per technique, for a model of width d and a draft vocabulary of n ids:

- every technique: verify slots, `depth` extra KV tokens per speculating
  sequence (global pages; the local ring already has the slack);
- ngram: nothing else (host-side lookup);
- mtp: K chained heads of 3 d^2 + d weights (w1 reads the state and a token
  embedding: 2d x d; w2: d x d), plus the draft-vocabulary slices of the
  tied embedding (n entries for each compiled n: n x d values of the compute
  dtype, or the table's own bytes per entry where it is served quantized) and
  their id lists;
- early_exit: one adapter (2 d^2 + d) and one vocabulary slice; it reads the
  target's own KV, so nothing per sequence;
- draft: one adapter and a slice (a truncated copy shares the target's layer
  weights; a separate model adds its weights), plus KV per sequence in pages
  the pool split lends out of the tenants' pool (engine/speculation/draft_model.py): the
  pages its layers need for the whole context (local layers: the window),
  each a whole page of the target's pool.

Resident bytes come out of the same budget as the KV pool (engine/memory/budget.py):
the loader sizes the pool from the budget minus them, so a larger MTP draft
vocabulary (`mtp_vocabs`) costs tenant pages.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import ModelConfig
from engine.memory.sizes import KV_DTYPE_BYTES, WEIGHT_BITS, pages_per_sequence

MTP_HEADS = 4
"""Heads `crossover train-heads` trains by default."""
DRAFT_LAYERS = 4
"""Draft model: layers of the truncated copy (default)."""
MTP_VOCABS = (8192, 32768)
"""Draft-vocabulary slices the MTP proposer keeps (plus the full table it shares)."""
LAYER_VOCAB = 8192
"""Draft vocabulary of the early-exit and draft-model proposers."""


@dataclass(frozen=True)
class TechniqueCost:
    """Memory of one technique."""

    technique: str
    resident_bytes: int
    """Held whatever the load: heads, adapters, vocabulary slices, draft weights."""
    per_sequence_bytes: int
    """Added by each speculating sequence at the planned context: verify slots, draft KV."""
    tenants_displaced: int = 0
    """Tenants at the planned context that this costs with `speculating` sequences."""
    speculating: int = 0
    """Sequences assumed to speculate at once for tenants_displaced."""


def _item(dtype: str) -> float:
    return float(WEIGHT_BITS[dtype]) / 8


def technique_costs(cfg: ModelConfig, weight_dtype: str, kv_dtype: str, context_len: int, page_size: int,
                    depth: int, sequence_bytes: int, speculating: int = 16,
                    mtp_vocabs: tuple[int, ...] = MTP_VOCABS,
                    entry_bytes: int | None = None) -> list[TechniqueCost]:
    """Costs of ngram, mtp, early_exit and draft for `cfg` (see the module docstring).
    `entry_bytes`: bytes of one draft-vocabulary entry where the tied table is served quantized
    (the slices keep its form); None: d_model values of weight_dtype.

    Example: for gemma3-270m in float32, MTP holds 4 x (3 x 640^2 + 640) x 4 bytes of
    heads plus (8192 + 32768) x 640 x 4 bytes of slices, about 117 MiB.
    """
    d, item = cfg.d_model, _item(weight_dtype)
    entry = entry_bytes if entry_bytes is not None else d * item
    kv_item = KV_DTYPE_BYTES[kv_dtype]
    head = (2 * d * d + d) * item
    chained_head = (3 * d * d + d) * item
    ids = 4  # int32 per draft-vocabulary id
    verify = depth * 2 * len(cfg.global_layers) * cfg.n_kv_heads * cfg.head_dim * kv_item
    dcfg = cfg.replace(n_layers=min(DRAFT_LAYERS, cfg.n_layers - 1))
    g, l = pages_per_sequence(dcfg, context_len, page_size, depth)
    per_layer_page = 2 * page_size * cfg.n_kv_heads * cfg.head_dim * kv_item
    draft_kv = per_layer_page * (g * len(cfg.global_layers) + l * len(cfg.local_layers))  # target pages
    rows = [
        ("ngram", 0, verify),
        ("mtp", MTP_HEADS * chained_head + sum(n * (entry + ids) for n in set(mtp_vocabs) if n), verify),
        ("early_exit", head + LAYER_VOCAB * (entry + ids), verify),
        ("draft", head + LAYER_VOCAB * (entry + ids), verify + draft_kv),
    ]
    out = []
    for name, resident, per_seq in rows:
        total = resident + speculating * per_seq
        displaced = -(-int(total) // sequence_bytes) if sequence_bytes and total else 0
        out.append(TechniqueCost(name, int(resident), int(per_seq), displaced, speculating))
    return out
