"""A roofline step-time model for `crossover report`'s predictions (stdlib only).

The planner (engine/memory/planner.py) knows each device's usable memory and
bandwidth and each model's bytes; it has no compute figure and no step time.
This module adds the peak dense bf16 matrix throughput of the two target
chips and prices one decode or verify step as the slower of streaming its
bytes and doing its FLOPs:

    step_s    = target_s + propose_s
    target_s  = max(bytes / bandwidth, flops / peak)
    bytes     = weights + B x KV read per sequence (global layers: the context; local: the window)
    flops     = B x q x (2 x params + 4 x q_dim x attended tokens, summed over layers),  q = 1 + depth
    propose_s = depth x max(draft bytes / bandwidth, draft flops / peak)     (ngram: 0)
    goodput   = B x (1 + sum of the measured per-position acceptance up to depth) / step_s

Assumptions (stated in the report): kernels reach the roofline (no launch,
host or scheduling overhead, so small batches are optimistic); every
sequence is at the planned context; early exit drafts with EXIT_LAYERS of the
target, the draft model is the first spec_memory.DRAFT_LAYERS layers, MTP
runs its chained heads, each a sequential pass per draft position over a
spec_memory.LAYER_VOCAB-wide vocabulary slice; acceptance measured on the
served model carries over to the one predicted.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import ModelConfig
from engine.memory.planner import H200, TPU_V6E_1, DeviceProfile
from engine.memory.sizes import KV_DTYPE_BYTES, WEIGHT_BITS, kv_bytes_per_token, weight_bytes
from engine.memory.spec_memory import DRAFT_LAYERS, LAYER_VOCAB, MTP_VOCABS

EXIT_LAYERS = 8
"""Target layers the early-exit proposer drafts with (train-heads' deepest default exit)."""


@dataclass(frozen=True)
class Chip:
    """A device profile from the planner plus its compute peak."""

    profile: DeviceProfile
    peak_flops: float
    """Dense bf16 matrix FLOP/s."""
    source: str

    @property
    def name(self) -> str:
        return self.profile.name


CHIPS: dict[str, Chip] = {
    "tpu-v6e-1": Chip(TPU_V6E_1, 918e12,
                      "Cloud TPU v6e (Trillium) spec: 918 TFLOP/s bf16, 1640 GB/s HBM, 32 GB per chip"),
    "h200": Chip(H200, 989e12,
                 "NVIDIA H200 SXM spec: 989 TFLOP/s dense bf16 (1979 with 2:4 sparsity), 4.8 TB/s HBM3e"),
}
"""The chips predictions are made for; bandwidth and memory are the planner's profiles."""


def _layer_params(cfg: ModelConfig) -> float:
    """Matrix parameters of one transformer block (q, k, v, o and the GeGLU MLP)."""
    d = cfg.d_model
    return d * (cfg.q_dim + 2 * cfg.kv_dim) + cfg.q_dim * d + 3 * d * cfg.ffn_dim


def _kv_read(cfg: ModelConfig, context: int, kv_dtype: str, layers: int | None = None) -> float:
    """KV bytes one sequence's attention reads at `context` tokens (first `layers` only if given)."""
    part = cfg if layers is None else cfg.replace(n_layers=min(layers, cfg.n_layers))
    g, loc = kv_bytes_per_token(part, kv_dtype)
    return g * context + loc * min(context, cfg.sliding_window)


def _attn_flops(cfg: ModelConfig, context: int, layers: int | None = None) -> float:
    """Attention FLOPs of one query row: QK^T and AV over the tokens each layer attends to."""
    n = cfg.n_layers if layers is None else min(layers, cfg.n_layers)
    part = cfg.replace(n_layers=n)
    tokens = len(part.global_layers) * context + len(part.local_layers) * min(context, cfg.sliding_window)
    return 4.0 * cfg.q_dim * tokens


def _time(chip: Chip, nbytes: float, flops: float) -> float:
    return max(nbytes / chip.profile.bandwidth_bytes_per_s, flops / chip.peak_flops)


def target_seconds(cfg: ModelConfig, chip: Chip, batch: int, query: int, context: int,
                   weight_dtype: str = "bfloat16", kv_dtype: str = "bfloat16") -> float:
    """One forward of `batch` sequences, `query` rows each, over the full model.

    Example: gemma3-1b in bf16 at batch 1 on a v6e-1 is bound by its 2 GB of weights: ~1.2 ms.
    """
    nbytes = weight_bytes(cfg.param_count(), weight_dtype) + batch * _kv_read(cfg, context, kv_dtype)
    flops = batch * query * (2.0 * cfg.param_count() + _attn_flops(cfg, context))
    return _time(chip, nbytes, flops)


def propose_seconds(technique: str, cfg: ModelConfig, chip: Chip, batch: int, depth: int, context: int,
                    weight_dtype: str = "bfloat16", kv_dtype: str = "bfloat16") -> float:
    """The proposer's work for one step: `depth` sequential draft passes (ngram: none)."""
    if technique in ("none", "ngram") or depth == 0:
        return 0.0
    item, d = WEIGHT_BITS[weight_dtype] / 8, cfg.d_model
    vocab = min(MTP_VOCABS) if technique == "mtp" else LAYER_VOCAB
    head_params = (3 if technique == "mtp" else 2) * d * d + vocab * d
    nbytes, flops = head_params * item, 2.0 * batch * head_params
    if technique in ("early_exit", "draft"):
        layers = EXIT_LAYERS if technique == "early_exit" else DRAFT_LAYERS
        layers = min(layers, cfg.n_layers - 1)
        nbytes += layers * _layer_params(cfg) * item + batch * _kv_read(cfg, context, kv_dtype, layers)
        flops += batch * (2.0 * layers * _layer_params(cfg) + _attn_flops(cfg, context, layers))
    elif technique != "mtp":
        raise ValueError(f"no step-time model for technique {technique!r}")
    return depth * _time(chip, nbytes, flops)


def expected_tokens(per_pos: list[float], depth: int) -> float:
    """Tokens one sequence emits per step: 1 + the unconditional acceptance of each position.

    >>> expected_tokens([0.8, 0.6, 0.3], 2)
    2.4
    """
    return 1.0 + sum(per_pos[:depth])


def goodput(technique: str, cfg: ModelConfig, chip: Chip, batch: int, depth: int, per_pos: list[float],
            context: int, weight_dtype: str = "bfloat16", kv_dtype: str = "bfloat16") -> float:
    """Predicted output tokens/s of `batch` sequences speculating `depth` deep (depth 0: plain)."""
    if weight_dtype not in WEIGHT_BITS or kv_dtype not in KV_DTYPE_BYTES:
        raise ValueError(f"unknown dtype {weight_dtype!r} / {kv_dtype!r}")
    depth = depth if technique != "none" else 0
    step = (target_seconds(cfg, chip, batch, 1 + depth, context, weight_dtype, kv_dtype)
            + propose_seconds(technique, cfg, chip, batch, depth, context, weight_dtype, kv_dtype))
    return batch * expected_tokens(per_pos, depth) / step


def predicted_crossover(technique: str, cfg: ModelConfig, chip: Chip, depth: int, per_pos: list[float],
                        context: int, batches: list[int], weight_dtype: str = "bfloat16") -> int | None:
    """The smallest of `batches` where the technique's predicted goodput is below plain's."""
    for b in sorted(batches):
        if (goodput(technique, cfg, chip, b, depth, per_pos, context, weight_dtype)
                < goodput("none", cfg, chip, b, 0, [], context, weight_dtype)):
            return b
    return None
