"""`crossover bench engine|telemetry`: measure, print progress, write JSON."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", metavar="WHAT")
    sub.required = True
    e = sub.add_parser("engine", help="decode/prefill throughput vs the memory roofline")
    e.add_argument("--out", default="bench-out/engine.json", help="JSON output file")
    e.add_argument("--model", default=None, help="a .gguf file or a HF Gemma 3 directory")
    e.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    e.add_argument("--batches", default="1,2,4,8,16,32,64", help="comma-separated batch sizes")
    e.add_argument("--new-tokens", type=int, default=32, help="tokens decoded per request")
    e.add_argument("--hf-baseline", default="bench/hf_baseline_result.json",
                   help="JSON from bench/hf_baseline.py to compare with (skipped if missing)")
    t = sub.add_parser("telemetry", help="recorder throughput and caller-side cost")
    t.add_argument("--out", default="bench-out/telemetry.json", help="JSON output file")
    t.add_argument("--seconds", type=float, default=5.0, help="duration of each phase")
    t.add_argument("--db", default=None, help="SQLAlchemy URL (default: a temporary SQLite file)")


def run(args: argparse.Namespace) -> int:
    from daemon.user_error import UserError

    if args.bench == "engine":
        from engine.bench import run_bench

        try:
            batches = tuple(int(b) for b in args.batches.split(","))
        except ValueError:
            raise UserError(f"--batches must be comma-separated integers, got {args.batches!r}") from None
        if any(b < 1 for b in batches) or args.new_tokens < 2:
            raise UserError(f"batch sizes must be >= 1 and --new-tokens >= 2 (got {args.batches!r}, {args.new_tokens})")
        run_bench(args.out, model=args.model, dtype=args.dtype, batches=batches,
                  new_tokens=args.new_tokens, hf_baseline=args.hf_baseline)
    elif args.bench == "telemetry":
        from telemetry.bench import run_bench as tel_bench

        if args.seconds <= 0:
            raise UserError(f"--seconds must be positive, got {args.seconds}")
        tel_bench(args.out, args.seconds, args.db)
    return 0
