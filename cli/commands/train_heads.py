"""`crossover train-heads`: train MTP heads and exit adapters on the frozen target."""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="a .gguf file or a Hugging Face Gemma 3 directory (default: Gemma 3 270M)")
    p.add_argument("--out", default=None,
                   help="heads file to write (default: the user cache, $XDG_CACHE_HOME/crossover/heads/"
                        "<model>.safetensors, which serve and the benches then load first)")
    p.add_argument("--prompts-per-kind", type=int, default=40,
                   help="workload prompts continued per kind (default 40)")
    p.add_argument("--gen-tokens", type=int, default=96, help="tokens generated per prompt (default 96)")
    p.add_argument("--mtp-heads", type=int, default=4, help="MTP heads to train (default 4)")
    p.add_argument("--medusa", action="store_true",
                   help="unchained (Medusa) MTP heads, each reading the hidden state alone")
    p.add_argument("--exits", default="4,8",
                   help="layer counts after which exit adapters are trained (default 4,8)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    from daemon.user_error import UserError

    try:
        exits = tuple(int(x) for x in args.exits.split(",") if x.strip())
    except ValueError:
        raise UserError(f"--exits {args.exits!r} is not a comma-separated list of layer counts") from None
    for name in ("prompts_per_kind", "gen_tokens", "epochs"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    if args.mtp_heads < 0 or args.mtp_heads > 8:
        raise UserError(f"--mtp-heads {args.mtp_heads} must be in [0, 8]")

    from daemon.progress import reporter
    from training.heads import TrainConfig, load_target, train_to_file

    progress = reporter()
    try:
        tc = TrainConfig(prompts_per_kind=args.prompts_per_kind, gen_tokens=args.gen_tokens,
                         n_mtp=args.mtp_heads, chained=not args.medusa, exits=exits, epochs=args.epochs,
                         seed=args.seed)
        engine = load_target(args.model, exits, progress)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    out, heads = train_to_file(engine, tc, args.out, progress)
    print(f"train-heads: wrote {out} ({heads.nbytes() / 2**20:.1f} MiB) in {heads.meta['minutes']} min",
          file=sys.stderr)
    print(json.dumps({"path": str(out), **heads.meta}, indent=2))
    return 0
