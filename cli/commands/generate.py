"""`crossover generate`: prompt in, streamed text out, no server."""

from __future__ import annotations

import argparse
import sys
import time
import uuid

from engine.config import WEIGHT_FORMS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", help="prompt text (default: read stdin)")
    p.add_argument("--model", default=None,
                   help="a .gguf file or a Hugging Face Gemma 3 directory (default: Gemma 3 270M)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="compute dtype (default: per backend)")
    p.add_argument("--weights", default=None, choices=WEIGHT_FORMS,
                   help="weights as served: gguf (the file's own quantized blocks), int8, bfloat16 or "
                        "float32 (default: --dtype's; without --dtype, gguf for a GGUF model on the CPU)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in Gemma's chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split the model and KV pool over N devices (default 1)")


def run(args: argparse.Namespace) -> int:
    from daemon.user_error import UserError
    from engine.types import Request, SamplingParams

    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt:
        raise UserError("empty prompt: pass it as an argument or on stdin")
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                        top_p=args.top_p, seed=args.seed, stop=tuple(args.stop))
    try:
        sp.validate()
    except ValueError as exc:
        raise UserError(str(exc)) from None
    engine = _load(args)
    tok = engine.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if args.chat else prompt
    ids = tok.encode(text)
    try:
        engine.add_request(Request(uuid.uuid4().hex, ids, sp))
    except ValueError as exc:
        raise UserError(str(exc)) from None
    t0, n, reason = time.perf_counter(), 0, None
    while engine.has_work():
        for ev in engine.step().events:
            sys.stdout.write(ev.text)
            sys.stdout.flush()
            n += len(ev.token_ids)
            reason = ev.finish_reason or reason
    dt = time.perf_counter() - t0
    print(f"\n[{len(ids)} prompt tokens, {n} generated in {dt:.2f}s ({n / dt:.1f} tok/s), "
          f"finish: {reason}]", file=sys.stderr)
    return 0


def _load(args):
    from daemon.progress import reporter
    from daemon.user_error import UserError
    from engine.loader import load_engine

    try:
        return load_engine(model=args.model, dtype=args.dtype, weights=args.weights,
                           max_batch=1, max_context=args.max_context,
                           speculation=False, progress=reporter(),
                           **({"tensor_parallel": args.tensor_parallel} if args.tensor_parallel != 1 else {}))
    except (ValueError, FileNotFoundError) as exc:
        raise UserError(str(exc)) from None
