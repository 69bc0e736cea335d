"""`crossover plan`: where a device's memory goes for a model, and how many tenants fit.

    crossover plan --device tpu-v6e-1 --model gemma3-27b --dtype int4 --context 8192
    crossover plan --device cpu --budget 8GiB --model 26B/4B --json

Exit status: 0 when the plan fits, 1 when it does not, 2 for a bad value.
Every value is checked here and a bad one raises `UserError` naming it; the
arithmetic is `engine.memory.planner` (stdlib only, so importing it keeps --help fast).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from decimal import Decimal

from daemon.user_error import UserError
from engine.config import QUANTIZED_FORMS, WEIGHT_FORMS
from engine.memory import planner, sizes
from engine.memory.planner import Plan
from engine.memory.sizes import format_bytes
from engine.memory.spec_memory import MTP_VOCABS

_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?(?:e[+-]?\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
GGUF_MODEL = "gemma3-270m"
"""The model whose GGUF file the engine ships with: the only one --weights gguf or int8 can count."""
_SIZE_HELP = "bytes with an optional unit: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (e.g. 8GiB, 512MiB, 2e9)"


def parse_size(flag: str, text: str) -> int:
    """'8GiB' -> 8589934592, '512MiB' -> 536870912, '2e9' -> 2000000000; UserError otherwise."""
    m = _SIZE.match(text)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise UserError(f"{flag} {text!r} is not a size ({_SIZE_HELP})")
    value = Decimal(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
    if value > 1 << 60:
        raise UserError(f"{flag} {text!r} is too large")
    return int(value)


def _int(flag: str, text: str, minimum: int) -> int:
    """An integer >= minimum, or UserError naming the flag and the value."""
    try:
        value = int(text)
    except ValueError:
        raise UserError(f"{flag} {text!r} is not an integer") from None
    if value < minimum:
        raise UserError(f"{flag} {text!r} must be >= {minimum}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    models = ", ".join(planner.MODEL_NAMES)
    parser.add_argument("--device", default="tpu-v6e-1",
                        help=f"one of {', '.join(planner.DEVICE_NAMES)} (default: %(default)s)")
    parser.add_argument("--budget", help="usable memory: cpu's budget (default 8GiB) or a cap "
                        f"below another device's usable memory; {_SIZE_HELP}")
    parser.add_argument("--model", default="gemma3-270m",
                        help=f"{models}, or TOTAL/ACTIVE parameters of a mixture of experts "
                        "(e.g. 26B/4B) (default: %(default)s)")
    parser.add_argument("--dtype", help=f"weight dtype: {', '.join(sizes.WEIGHT_BITS)} (default: "
                        "bfloat16; float32 under --weights gguf or int8)")
    parser.add_argument("--weights", choices=WEIGHT_FORMS,
                        help="weights as the engine serves them: gguf (the model file's own quantized "
                        "blocks) or int8 count the exact bytes of the default model's GGUF; bfloat16 or "
                        "float32 are --dtype (default: --dtype; with neither, what the daemon serves: "
                        f"gguf for {GGUF_MODEL} on cpu, else bfloat16)")
    parser.add_argument("--kv-dtype", default="bfloat16",
                        help=f"KV dtype: {', '.join(sizes.KV_DTYPE_BYTES)} (default: %(default)s)")
    parser.add_argument("--context", default="8192", help="tokens per tenant (default: %(default)s)")
    parser.add_argument("--page-size", default="16", help="tokens per KV page (default: %(default)s)")
    parser.add_argument("--spec-depth", default="8",
                        help="speculative verify slots per sequence (default: %(default)s)")
    parser.add_argument("--speculation", default="0",
                        help="memory set aside for speculation, as a size (default: %(default)s)")
    parser.add_argument("--technique", default="", help="count this speculative technique's resident "
                        "bytes (heads, draft-vocabulary slices, adapters) in speculation: ngram, mtp, "
                        "early_exit or draft (default: none)")
    parser.add_argument("--draft-vocabs", default=",".join(map(str, MTP_VOCABS)), metavar="N,N",
                        help="MTP draft vocabularies kept resident (default: %(default)s)")
    parser.add_argument("--split", default="0", help="pool split: share of the KV pool's pages lent to "
                        "speculation, in [0, 1) (default: %(default)s)")
    parser.add_argument("--reserve", help="activation/workspace reserve, as a size "
                        "(default: 1GiB + 64 seqs x (1 + depth) x vocab x float32 x 2)")
    for flag in ("--layers", "--kv-heads", "--head-dim"):
        parser.add_argument(flag, help="MoE only: attention shape override (default: gemma3-12b's)")
    parser.add_argument("--tensor-parallel", default="1", metavar="N",
                        help="split the model over N such devices: weights and KV per device (default 1)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def build_plan(args: argparse.Namespace) -> Plan:
    """The plan for parsed arguments; UserError for any bad value."""
    moe_shape = {key: None if getattr(args, key) is None else _int(f"--{key.replace('_', '-')}",
                                                                   getattr(args, key), 1)
                 for key in ("layers", "kv_heads", "head_dim")}
    budget = None if args.budget is None else parse_size("--budget", args.budget)
    reserve = None if args.reserve is None else parse_size("--reserve", args.reserve)
    dtype, served = _weights(args)
    try:
        device = planner.device_profile(args.device, budget)
        model = planner.model_by_name(args.model, moe_shape["layers"], moe_shape["kv_heads"],
                                      moe_shape["head_dim"])
        return planner.make_plan(
            model, device, dtype, args.kv_dtype, served=served,
            context_len=_int("--context", args.context, 1),
            page_size=_int("--page-size", args.page_size, 1),
            max_spec_depth=_int("--spec-depth", args.spec_depth, 0),
            activation_reserve_bytes=reserve,
            speculation_bytes=parse_size("--speculation", args.speculation),
            tensor_parallel=_int("--tensor-parallel", args.tensor_parallel, 1),
            technique=args.technique, pool_split=_split(args.split),
            mtp_vocabs=tuple(_int("--draft-vocabs", v, 0) for v in args.draft_vocabs.split(",")),
        )
    except ValueError as exc:
        raise UserError(str(exc)) from None


def default_weights(device: str, model: str) -> str:
    """The weights form the daemon serves when neither --weights nor --dtype is given: the default
    model's own GGUF blocks on the CPU, where its quantized-matmul kernel runs
    (engine.loader.default_weights), else bfloat16.

    >>> default_weights("cpu", "gemma3-270m"), default_weights("tpu-v6e-1", "gemma3-270m")
    ('gguf', 'bfloat16')
    """
    return "gguf" if device == "cpu" and model == GGUF_MODEL else "bfloat16"


def _weights(args: argparse.Namespace) -> tuple[str, tuple[str, int, int] | None]:
    """(the dtype the planner prices, (form, bytes, bytes of one tied-table entry) of quantized
    served weights, or None)."""
    weights = args.weights or (None if args.dtype else default_weights(args.device, args.model))
    if weights is None or weights not in QUANTIZED_FORMS:
        return weights or args.dtype, None
    if args.dtype not in (None, "float32"):
        raise UserError(f"--dtype {args.dtype} contradicts --weights {weights} (which computes in float32)")
    if args.model != GGUF_MODEL:
        raise UserError(f"--weights {weights} counts the default model's GGUF ({GGUF_MODEL}); for "
                        f"--model {args.model} estimate with --dtype int8 or int4")
    from engine.model.gguf_file import GGUFFile, WeightsError, default_gguf_path

    try:
        gf = GGUFFile.open(default_gguf_path())
    except WeightsError as exc:  # the model package missing or damaged: say so, and how to plan without it
        raise UserError(f"--weights {weights}: {exc} (or plan another form with --dtype)") from None
    tensors = [(t.shape, t.qtype.name) for t in gf.tensors.values()]
    table = gf.tensors["token_embd.weight"]
    entry = sizes.served_bytes([((1, table.shape[-1]), table.qtype.name)], weights)  # one table entry
    return "float32", (weights, sizes.served_bytes(tensors, weights), entry)


def _split(text: str) -> float:
    """A pool split in [0, 1), or UserError naming --split."""
    try:
        share = float(text)
    except ValueError:
        raise UserError(f"--split {text!r} is not a number") from None
    if not 0.0 <= share < 1.0:
        raise UserError(f"--split {text!r} must be in [0, 1)")
    return share


def _count(n: int) -> str:
    """Parameters in B or M: 268098176 -> '268.10 M'."""
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def format_plan(plan: Plan) -> str:
    """The plan as a two-column table in human units."""
    f, dev = format_bytes, plan.device
    params = f"{_count(plan.total_params)} parameters"
    if plan.active_params != plan.total_params:
        params += f" in total, {_count(plan.active_params)} active per token (MoE)"
    rows = [
        ("model", f"{plan.model}: {params}"),
        ("device", f"{dev.name}: {f(dev.usable_bytes)} usable of {f(dev.total_bytes)}, "
                   f"{dev.bandwidth_bytes_per_s / 1e12:.2f} TB/s"),
        ("weights", " | ".join(f"{d} {f(b)}" for d, b in plan.weight_bytes_by_dtype.items())),
        ("  chosen", f"{plan.weight_dtype} {f(plan.weight_bytes)}; streaming the active weights "
                     f"once takes {plan.decode_weight_read_s * 1e3:.2f} ms"),
        ("KV / token", f"global {f(plan.kv_global_bytes_per_token)} ({plan.global_layers} layers)"
                       f" + local {f(plan.kv_local_bytes_per_token)} ({plan.local_layers} "
                       f"layers, window {plan.sliding_window}), {plan.kv_dtype}"),
        ("reserve", f(plan.activation_reserve_bytes)),
        ("speculation", f"{f(plan.speculation_bytes)}"
                        + (f" ({plan.technique}'s resident bytes included)" if plan.technique else "")
                        + f", displaces {plan.tenants_displaced} tenants"),
        ("KV pool", f(plan.pool_bytes)),
    ]
    if plan.pools is not None:
        p = plan.pools
        rows.append(("pages", f"{plan.page_size} tokens/page: global {p.num_global_pages} x "
                              f"{f(p.global_page_bytes)}, local {p.num_local_pages} x "
                              f"{f(p.local_page_bytes)} (ring of {p.ring_pages} per sequence)"))
    ratio = f" ({plan.tenant_ratio:.2f}x)" if plan.tenant_ratio is not None else ""
    rows += [
        ("per sequence", f"{plan.context_len} tokens: {f(plan.sequence_bytes)} paged + windowed,"
                         f" {f(plan.naive_sequence_bytes)} naive"),
        ("tenants", f"{plan.tenants} paged + windowed vs {plan.naive_tenants} naive{ratio}"),
    ]
    if plan.weight_dtype != "float32":
        gained, f32 = plan.tenants - plan.float32_tenants, f(plan.weight_bytes_by_dtype["float32"])
        rows.append(("  vs float32", f"{gained:+d} tenants at {plan.context_len} tokens: float32 weights "
                                     f"({f32}) leave room for {plan.float32_tenants}"))
    rows.append(("verdict", plan.verdict))
    if plan.split is not None:
        sp = plan.split
        rows.append(("pool split", f"{sp.share:g}: lends {f(sp.lent_bytes)} ({sp.lent_global_pages} global + "
                                   f"{sp.lent_local_pages} local pages) to speculation, tenants keep "
                                   f"{f(sp.tenant_bytes)}: {sp.tenants} tenants instead of "
                                   f"{sp.tenants_unsplit} (displaces {sp.tenants_displaced}); the lent pages "
                                   f"hold the draft model's KV for {sp.draft_sequences} sequences"))
    for i, t in enumerate(plan.techniques):
        rows.append(("per technique" if i == 0 else "", f"{t.technique:<10} resident "
                     f"{f(t.resident_bytes):>10} + {f(t.per_sequence_bytes):>10}/sequence: displaces "
                     f"{t.tenants_displaced} tenants with {t.speculating} speculating"))
    rows += [("notes" if i == 0 else "", note) for i, note in enumerate(plan.notes)]
    width = max(len(label) for label, _ in rows)
    head = f"memory plan: {plan.model} on {dev.name}, context {plan.context_len}"
    return "\n".join([head] + [f"  {label:<{width}}  {value}" for label, value in rows])


def run(args: argparse.Namespace) -> int:
    """Print the plan; exit 0 when it fits, 1 when it does not."""
    plan = build_plan(args)
    if args.json:
        print(json.dumps(dataclasses.asdict(plan), indent=2))
    else:
        print(format_plan(plan))
    return 0 if plan.fits else 1
