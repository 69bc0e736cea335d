"""Memory planner: how many tenants' KV caches fit beside the weights on one device.

Pure arithmetic over frozen dataclasses; nothing here touches a device.
`crossover plan` prints `make_plan`.

The byte arithmetic (dtype sizes, KV per token, pages per sequence, the
pool split) is engine/memory/sizes.py; what each speculative technique costs is
engine/memory/spec_memory.py. This module adds the devices, the model names
(Gemma 3 presets and mixture-of-experts specs) and the budget that ties them
together: usable memory - weights - activation reserve - speculation = KV pool.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from decimal import Decimal

from engine.config import GEMMA3_12B, PRESETS, ModelConfig
from engine.memory.sizes import (
    WEIGHT_BITS,
    GiB,
    MiB,
    PoolSizes,
    PoolSplit,
    format_bytes,
    kv_bytes_per_token,
    naive_sequence_bytes,
    sequence_bytes,
    size_pool,
    split_pool,
    weight_bytes,
)
from engine.memory.spec_memory import DRAFT_LAYERS, MTP_VOCABS, TechniqueCost, technique_costs

DEFAULT_MAX_BATCH = 64
"""Sequences per decode step assumed by the default activation reserve."""
WORKSPACE_BYTES = 1 * GiB
"""Fixed part of the default reserve: XLA scratch, executables, prefill activations."""
LOGIT_COPIES = 2
"""float32 logits plus one same-sized copy (sampling weights)."""


@dataclass(frozen=True)
class DeviceProfile:
    """One accelerator's memory as the planner sees it."""

    name: str
    """Profile name, as given to `crossover plan --device`."""
    total_bytes: int
    """Physical memory of the device (informational)."""
    usable_bytes: int
    """Bytes the daemon may allocate: weights + reserve + speculation + KV pool."""
    bandwidth_bytes_per_s: float
    """Memory bandwidth (informational: streaming the weights bounds a decode step)."""
    note: str = ""
    """Where the numbers come from, assumptions included."""


TPU_V6E_1 = DeviceProfile(
    "tpu-v6e-1", 32 * GiB, int(28.7 * GiB), 1.64e12,
    "32 GB HBM, 28.7 GiB usable after the TPU runtime's own reservation",
)
H200 = DeviceProfile(
    "h200", 143_771 * MiB, 135 * GiB, 4.8e12,
    "141 GB HBM3e (nvidia-smi: 143771 MiB); assumed ~139 GiB visible to XLA minus a 4 GiB "
    "runtime reserve (CUDA context, cuBLAS/cuDNN workspaces, XLA scratch outside its pool); "
    "needs XLA_PYTHON_CLIENT_MEM_FRACTION raised from JAX's default 0.75",
)
DEVICE_NAMES: tuple[str, ...] = ("cpu", "tpu-v6e-1", "h200")


def device_profile(name: str, budget_bytes: int | None = None) -> DeviceProfile:
    """The named profile; `budget_bytes` sets cpu's budget (default 8 GiB) or caps another's."""
    if budget_bytes is not None and budget_bytes <= 0:
        raise ValueError(f"budget {budget_bytes} bytes must be positive")
    if name == "cpu":
        budget = 8 * GiB if budget_bytes is None else budget_bytes
        return DeviceProfile("cpu", budget, budget, 50e9,
                             "host RAM budget (default 8 GiB); bandwidth is a rough DDR5 figure")
    dev = {"tpu-v6e-1": TPU_V6E_1, "h200": H200}.get(name)
    if dev is None:
        raise ValueError(f"unknown device {name!r} (choose {', '.join(DEVICE_NAMES)})")
    if budget_bytes is None:
        return dev
    if budget_bytes > dev.usable_bytes:
        raise ValueError(f"budget {format_bytes(budget_bytes)} exceeds {name}'s usable "
                         f"{format_bytes(dev.usable_bytes)}")
    return dataclasses.replace(dev, usable_bytes=budget_bytes,
                               note=f"{dev.note}; capped to a {format_bytes(budget_bytes)} budget")


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts model known by its parameter counts, with a borrowed attention shape."""

    name: str
    """The spec it was parsed from, e.g. "26B/4B"."""
    total_params: int
    """Every expert counted: what the weights occupy."""
    active_params: int
    """Parameters one token reads: what a decode step streams."""
    attention: ModelConfig
    """Attention shape used for the KV arithmetic (layers, KV heads, head_dim, window)."""
    attention_note: str
    """Where that shape came from; printed with the plan."""


_COUNT = re.compile(r"^\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([kmbt]?)\s*$", re.IGNORECASE)
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}


def _parse_count(text: str, spec: str) -> int:
    """'26B' -> 26_000_000_000; '4e9' -> 4_000_000_000."""
    m = _COUNT.match(text)
    if not m:
        raise ValueError(f"bad parameter count {text!r} in {spec!r} (e.g. 26B/4B or 26e9/4e9)")
    return int(Decimal(m.group(1)) * _COUNT_UNITS[m.group(2).lower()])


def parse_moe(
    spec: str, n_layers: int | None = None, n_kv_heads: int | None = None,
    head_dim: int | None = None,
) -> MoEConfig:
    """"26B/4B" -> MoEConfig(total 26e9, active 4e9) with gemma3-12b's attention unless overridden."""
    total_text, sep, active_text = spec.partition("/")
    if not sep:
        raise ValueError(f"MoE spec {spec!r} must be TOTAL/ACTIVE, e.g. 26B/4B")
    total, active = _parse_count(total_text, spec), _parse_count(active_text, spec)
    if not 0 < active <= total:
        raise ValueError(f"MoE spec {spec!r}: need 0 < active ({active}) <= total ({total})")
    given = {"layers": n_layers, "kv-heads": n_kv_heads, "head-dim": head_dim}
    if any(v is not None and v <= 0 for v in given.values()):
        raise ValueError(f"MoE attention overrides must be positive, got {given}")
    base = GEMMA3_12B
    kv_heads = n_kv_heads or base.n_kv_heads
    attn = base.replace(
        name=f"{spec.strip()} attention", n_layers=n_layers or base.n_layers,
        n_kv_heads=kv_heads, n_heads=kv_heads * (base.n_heads // base.n_kv_heads),
        head_dim=head_dim or base.head_dim,
    )
    overridden = ", ".join(k for k, v in given.items() if v is not None)
    note = (
        f"MoE attention shape from {base.name}: {attn.n_layers} layers "
        f"({len(attn.global_layers)} global, {len(attn.local_layers)} local, window "
        f"{attn.sliding_window}), {attn.n_kv_heads} KV heads x {attn.head_dim}; "
        + (f"overridden: {overridden}" if overridden else "override with layers/kv-heads/head-dim")
    )
    return MoEConfig(spec.strip(), total, active, attn, note)


MODEL_NAMES: tuple[str, ...] = tuple(PRESETS)


def model_by_name(
    name: str, n_layers: int | None = None, n_kv_heads: int | None = None,
    head_dim: int | None = None,
) -> ModelConfig | MoEConfig:
    """A Gemma 3 preset by name, or an MoE from "TOTAL/ACTIVE" (overrides apply to MoE only)."""
    if "/" in name:
        return parse_moe(name, n_layers, n_kv_heads, head_dim)
    if name not in PRESETS:
        raise ValueError(
            f"unknown model {name!r} (choose {', '.join(MODEL_NAMES)}, "
            "or TOTAL/ACTIVE parameters for a mixture of experts, e.g. 26B/4B)"
        )
    if (n_layers, n_kv_heads, head_dim) != (None, None, None):
        raise ValueError(f"layers / kv-heads / head-dim overrides apply to MoE models, not {name!r}")
    return PRESETS[name]


def activation_reserve(
    cfg: ModelConfig, max_spec_depth: int, max_batch: int = DEFAULT_MAX_BATCH,
) -> tuple[int, str]:
    """(bytes, explanation): WORKSPACE_BYTES + max_batch x (1 + depth) x vocab x float32 x 2."""
    positions = 1 + max_spec_depth
    logits = max_batch * positions * cfg.vocab_size * 4 * LOGIT_COPIES
    note = (
        f"activation reserve {format_bytes(WORKSPACE_BYTES + logits)} = "
        f"{format_bytes(WORKSPACE_BYTES)} workspace + logits {max_batch} seqs x {positions} "
        f"positions x {cfg.vocab_size} vocab x float32 x {LOGIT_COPIES}"
    )
    return WORKSPACE_BYTES + logits, note


@dataclass(frozen=True)
class Plan:
    """Where a device's memory goes for one model, and how many tenants that leaves room for."""

    model: str
    """Model name (preset name or MoE spec)."""
    device: DeviceProfile
    """The device planned for."""
    weight_dtype: str
    """Dtype the weights are stored in."""
    kv_dtype: str
    """Dtype of the KV pages."""
    context_len: int
    """Tokens per tenant the plan is sized for (verify slots included)."""
    page_size: int
    """Tokens per KV page."""
    max_spec_depth: int
    """Speculative verify slots each sequence's local ring keeps room for."""
    total_params: int
    """Parameters stored (every expert of an MoE)."""
    active_params: int
    """Parameters read per token (== total_params for a dense model)."""
    weight_bytes_by_dtype: dict[str, int]
    """Weight bytes in each of float32, bfloat16, int8, int4 (scales included), and the served form's."""
    weight_bytes: int
    """Weight bytes in weight_dtype."""
    decode_weight_read_s: float
    """Seconds to stream the active weights once at the device's bandwidth (decode-step floor)."""
    global_layers: int
    """Layers attending to the whole context."""
    local_layers: int
    """Sliding-window layers."""
    sliding_window: int
    """Tokens a local layer attends to."""
    kv_global_bytes_per_token: int
    """K+V bytes per token over all global layers."""
    kv_local_bytes_per_token: int
    """K+V bytes per token over all local layers (held only for the window)."""
    activation_reserve_bytes: int
    """Kept back for activations, logits and XLA workspace."""
    speculation_bytes: int
    """Kept back for speculation (draft weights, draft KV, ...)."""
    pool_bytes: int
    """KV pool: usable - weights - reserve - speculation (0 when negative)."""
    pools: PoolSizes | None
    """The pool split at context_len; None when not one sequence fits."""
    sequence_bytes: int
    """KV bytes of one context_len sequence, paged with windowed local layers."""
    naive_sequence_bytes: int
    """KV bytes of one context_len sequence in a contiguous all-layers cache."""
    tenants: int
    """Sequences of context_len that fit, paged and windowed."""
    naive_tenants: int
    """Sequences of context_len that fit in a naive cache."""
    tenant_ratio: float | None
    """tenants / naive_tenants (None when the naive cache fits none)."""
    tenants_displaced: int
    """Tenants at context_len that speculation_bytes costs."""
    fits: bool
    """Whether weights, reserve, speculation and at least one sequence fit."""
    shortfall_bytes: int
    """Bytes missing for the first constraint that fails (0 when it fits)."""
    verdict: str
    """One line: fits with how many tenants, or what does not fit and by how much."""
    notes: tuple[str, ...]
    """Assumptions behind the numbers (reserve formula, borrowed shapes, device)."""
    techniques: tuple[TechniqueCost, ...] = ()
    """Per speculative technique: resident and per-sequence bytes, tenants displaced."""
    tensor_parallel: int = 1
    """Devices the model is split over; weight_bytes, the pool and sequence bytes are per device."""
    technique: str = ""
    """The technique whose resident bytes speculation_bytes includes ("" when none)."""
    split: PoolSplit | None = None
    """The pool split: pages lent to speculation (the draft model's KV) and tenants left."""
    float32_tenants: int = 0
    """Sequences of context_len that fit with float32 weights in the same budget: the served form
    gains tenants - float32_tenants."""


def _share(units: int, n: int) -> float:
    """Share of an array each of n devices holds, split along `units` (engine/model/sharding.py's rule:
    split when they divide evenly, else replicated). Example: _share(4, 2) == 0.5, _share(1, 2) == 1.0."""
    return 1.0 / n if n > 1 and units % n == 0 else 1.0


def per_device_params(cfg: ModelConfig, n: int) -> float:
    """Parameters one of n devices holds under engine/model/sharding.py's layout: vocabulary-split
    embedding, head-split attention (KV heads replicated when they do not divide), split MLP."""
    d, f, L = cfg.d_model, cfg.ffn_dim, cfg.n_layers
    split = (cfg.vocab_size * d * _share(cfg.vocab_size, n)
             + L * 2 * cfg.q_dim * d * _share(cfg.n_heads, n)
             + L * 2 * cfg.kv_dim * d * _share(cfg.n_kv_heads, n)
             + L * 3 * d * f * _share(f, n))
    whole = cfg.vocab_size * d + L * (2 * cfg.q_dim * d + 2 * cfg.kv_dim * d + 3 * d * f)
    return split + (cfg.param_count() - whole)


def _verdict(
    weights: int, reserve: int, spec: int, pool: int, seq: int, device: DeviceProfile,
    weight_dtype: str, context_len: int,
) -> tuple[bool, int, str]:
    """(fits, shortfall, message) for the first budget constraint that fails."""
    f, usable = format_bytes, device.usable_bytes
    over = f"> usable {f(usable)} on {device.name}"
    if weights > usable:
        short = weights - usable
        return False, short, (f"does not fit: weights {f(weights)} ({weight_dtype}) {over}, "
                              f"short by {f(short)}")
    if weights + reserve > usable:
        short = weights + reserve - usable
        return False, short, (f"does not fit: weights {f(weights)} + activation reserve "
                              f"{f(reserve)} {over}, short by {f(short)}")
    if pool < 0:
        return False, -pool, (f"does not fit: weights {f(weights)} + activation reserve "
                              f"{f(reserve)} + speculation {f(spec)} {over}, short by {f(-pool)}")
    if pool < seq:
        return False, seq - pool, (f"does not fit: KV pool {f(pool)} < one sequence of "
                                   f"{context_len} tokens ({f(seq)}), short by {f(seq - pool)}")
    return True, 0, ""


def make_plan(
    model: ModelConfig | MoEConfig, device: DeviceProfile, weight_dtype: str, kv_dtype: str,
    context_len: int, page_size: int = 16, max_spec_depth: int = 8,
    activation_reserve_bytes: int | None = None, speculation_bytes: int = 0, tensor_parallel: int = 1,
    technique: str = "", pool_split: float = 0.0, mtp_vocabs: tuple[int, ...] = MTP_VOCABS,
    served: tuple[str, int] | tuple[str, int, int] | None = None,
) -> Plan:
    """Plan `model` on `device`; activation_reserve_bytes=None uses `activation_reserve`.

    One budget (engine/memory/budget.py): `technique`'s resident bytes (heads, draft-vocabulary
    slices `mtp_vocabs`, adapters) join `speculation_bytes` before the KV pool is sized, and
    `pool_split` of the pool's pages is lent to speculation (`Plan.split`).

    `tensor_parallel` > 1: the model is split over that many such devices (engine/model/sharding.py);
    weights, the KV pool and each sequence's KV are then counted per device.

    `served`: (form, bytes[, entry bytes]) of weights the engine serves quantized
    (engine/memory/sizes.served_bytes of the model file: gguf or int8); those bytes replace
    weight_dtype's estimate, weight_dtype (the compute dtype) prices speculation's float heads, and
    the bytes of one tied-table entry, where given, its draft-vocabulary slices (which keep the
    table's form)."""
    moe = model if isinstance(model, MoEConfig) else None
    cfg = moe.attention if moe else model
    total = moe.total_params if moe else cfg.param_count()
    active = moe.active_params if moe else total
    weights = weight_bytes(total, weight_dtype) if served is None else served[1]
    label, read = (served[0], served[1]) if served else (weight_dtype, weight_bytes(active, weight_dtype))
    g_tok, l_tok = kv_bytes_per_token(cfg, kv_dtype)
    seq = sequence_bytes(cfg, context_len, page_size, kv_dtype, max_spec_depth)
    naive = naive_sequence_bytes(cfg, context_len, kv_dtype)
    notes = [moe.attention_note] if moe else []
    if activation_reserve_bytes is None:
        reserve, reserve_note = activation_reserve(cfg, max_spec_depth)
    else:
        reserve, reserve_note = activation_reserve_bytes, (
            f"activation reserve {format_bytes(activation_reserve_bytes)} (given)")
    if reserve < 0 or speculation_bytes < 0:
        raise ValueError(f"activation_reserve_bytes={reserve} and speculation_bytes="
                         f"{speculation_bytes} must be >= 0")
    notes.append(reserve_note)
    if context_len > cfg.max_position:
        notes.append(f"context {context_len} exceeds the trained max_position {cfg.max_position}")
    if device.note:
        notes.append(f"{device.name}: {device.note}")
    kv_share = 1.0
    if tensor_parallel > 1 and served is not None:
        raise ValueError(f"{label} weights serve on one device (tensor_parallel={tensor_parallel})")
    float32_weights = weight_bytes(total, "float32")
    if tensor_parallel > 1:
        dev_params = total / tensor_parallel if moe else per_device_params(cfg, tensor_parallel)
        weights = weight_bytes(int(dev_params), weight_dtype)
        float32_weights = weight_bytes(int(dev_params), "float32")
        kv_share = _share(cfg.n_kv_heads, tensor_parallel)
        seq, naive = int(seq * kv_share), int(naive * kv_share)
        heads = "KV heads split" if kv_share < 1 else "KV heads replicated: each device holds the whole pool"
        notes.append(f"tensor parallel over {tensor_parallel} devices: weights and KV per device "
                     f"({heads}{'; MoE weights assumed split evenly' if moe else ''}); reserve not divided")
    elif tensor_parallel < 1:
        raise ValueError(f"tensor_parallel={tensor_parallel} must be >= 1")

    costs = technique_costs(cfg, weight_dtype, kv_dtype, context_len, page_size, max_spec_depth, seq,
                            mtp_vocabs=mtp_vocabs,
                            entry_bytes=served[2] if served and len(served) > 2 else None)
    if technique:
        by_name = {c.technique: c for c in costs}
        if technique not in by_name:
            raise ValueError(f"unknown technique {technique!r} (choose {', '.join(by_name)})")
        speculation_bytes += by_name[technique].resident_bytes
    pool = device.usable_bytes - weights - reserve - speculation_bytes
    fits, shortfall, verdict = _verdict(
        weights, reserve, speculation_bytes, pool, seq, device, label, context_len)
    held = max(pool, 0)
    tenants, naive_tenants = held // seq, held // naive
    displaced = max(pool + speculation_bytes, 0) // seq - tenants
    float32_tenants = max(pool + weights - float32_weights, 0) // seq
    ratio = tenants / naive_tenants if naive_tenants else None
    pools = (size_pool(cfg, int(held / kv_share), page_size, kv_dtype, context_len, max_spec_depth)
             if tenants else None)
    if fits:
        verdict = (f"fits: {tenants} tenants at {context_len} tokens paged + windowed vs "
                   f"{naive_tenants} with a naive cache"
                   + (f" ({ratio:.2f}x)" if ratio is not None else ""))
    by_dtype = {d: weight_bytes(total, d) for d in WEIGHT_BITS} | ({label: weights} if served else {})
    return Plan(
        model=moe.name if moe else cfg.name, device=device, weight_dtype=label,
        kv_dtype=kv_dtype, context_len=context_len, page_size=page_size,
        max_spec_depth=max_spec_depth, total_params=total, active_params=active,
        weight_bytes_by_dtype=by_dtype,
        weight_bytes=weights, decode_weight_read_s=read / device.bandwidth_bytes_per_s,
        global_layers=len(cfg.global_layers), local_layers=len(cfg.local_layers),
        sliding_window=cfg.sliding_window,
        kv_global_bytes_per_token=g_tok, kv_local_bytes_per_token=l_tok,
        activation_reserve_bytes=reserve, speculation_bytes=speculation_bytes,
        pool_bytes=held,
        pools=pools,
        sequence_bytes=seq, naive_sequence_bytes=naive, tenants=tenants,
        naive_tenants=naive_tenants, tenant_ratio=ratio, tenants_displaced=displaced,
        fits=fits, shortfall_bytes=shortfall, verdict=verdict, notes=tuple(notes),
        techniques=tuple(costs), tensor_parallel=tensor_parallel, technique=technique,
        split=split_pool(cfg, pools, pool_split, context_len, page_size, max_spec_depth, DRAFT_LAYERS)
        if pools else None,
        float32_tenants=float32_tenants,
    )
