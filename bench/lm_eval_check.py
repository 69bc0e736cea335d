"""`crossover bench lm-eval`: lm-eval's `local-completions` model runs a multiple-choice task against
the daemon, and its accuracy is compared with the one the engine's own loglikelihoods give.

1. The task (bench/workloads/mc_task.py: 60 questions, four choices) is copied to a work folder.
2. The daemon: `--url`, or a `crossover serve` child at its defaults (a fresh SQLite file),
   waited for until /ready says every technique is compiled.
3. lm-eval (any environment holding `lm-eval[api]`; `--lm-eval` names its executable) scores each
   choice through /v1/completions with `echo` and `logprobs` (its remote tokenizer reads the
   daemon's /tokenize), `--log_samples` keeping each choice's loglikelihood.
4. Directly: the same token ids (lm-eval's context/continuation split, with the model's own
   tokenizer) through a dense forward of the same weights in this process (engine/model/gemma.py,
   no pages, no ragged calls), each continuation token's log-softmax summed.
5. The JSON: both accuracies, each item's pick by either, the largest loglikelihood difference;
   `passed` when the accuracies and every pick are equal.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.workloads import mc_task

PAD_TO = 128
"""Token length the dense forward pads every scored sequence to: one compile for the task."""
SCORED = 16
"""Most continuation tokens of one choice: the output layer runs at these positions alone."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="crossover bench lm-eval", description=__doc__.split("\n")[0])
    add_flags(p)
    return run_flags(p.parse_args(argv))


def add_flags(p: argparse.ArgumentParser) -> None:
    """The command's flags (`crossover bench lm-eval`, or `python -m bench.lm_eval_check`)."""
    p.add_argument("--url", help="a running daemon (default: start `crossover serve` at its defaults)")
    p.add_argument("--lm-eval", default=shutil.which("lm_eval") or shutil.which("lm-eval"),
                   help="lm-eval's executable (pip install 'lm-eval[api]' in any environment)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per request lm-eval sends")
    p.add_argument("--api-key", help="a tenant key, when the daemon asks for one")
    p.add_argument("--out", type=Path, help="write the JSON here as well as to stdout")


def run_flags(args: argparse.Namespace) -> int:
    """Run with parsed flags; the exit status (1: the accuracies or picks differ)."""
    if not args.lm_eval or not Path(args.lm_eval).exists():
        print("crossover bench lm-eval: lm-eval not found; install it (pip install 'lm-eval[api]', any "
              f"environment) and pass --lm-eval PATH (got {args.lm_eval!r})", file=sys.stderr)
        return 2
    if args.batch_size < 1:
        print(f"crossover bench lm-eval: --batch-size must be >= 1, got {args.batch_size}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="crossover-lm-eval-") as work:
        result = run(Path(work), args.url, args.lm_eval, args.batch_size, args.api_key)
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    return 0 if result["passed"] else 1


def run(work: Path, url: str | None, lm_eval: str, batch_size: int, api_key: str | None) -> dict[str, Any]:
    import asyncio

    from bench.serve import served_model  # aiohttp and the load generator: not at the CLI's start

    task = work / "task"
    mc_task.write(task)
    daemon = None if url else _started_daemon(work)
    try:
        base = url.rstrip("/") if url else daemon.base
        model = asyncio.run(served_model(base, api_key))
        started = time.monotonic()
        samples, summary = _lm_eval(lm_eval, base, model, task, work / "out", batch_size, api_key)
        lm_eval_s = time.monotonic() - started
    finally:
        if daemon is not None:
            daemon.stop()
    direct = direct_loglikelihoods(mc_task.items())
    return compare(samples, summary, direct, lm_eval_s, model)


def _started_daemon(work: Path) -> Any:
    """`crossover serve` at its defaults as a child (keys not required), once /ready says every
    technique is compiled (as `crossover bench structured` starts one)."""
    import asyncio

    from bench.soak_daemon import Daemon, SoakConfig
    from bench.soak_run import Soak

    daemon = Daemon(work, SoakConfig(serve_args=("--open",)))

    async def ready() -> None:
        import aiohttp

        soak = Soak(SoakConfig(), daemon, lambda line: print(line, file=sys.stderr, flush=True))
        async with aiohttp.ClientSession() as session:
            soak.session = session
            await soak.wait_ready()

    try:
        asyncio.run(ready())
    except BaseException:
        daemon.stop()
        raise
    return daemon


def compare(samples: list[dict[str, Any]], summary: dict[str, Any], direct: list[list[float]],
            lm_eval_s: float, model: str) -> dict[str, Any]:
    """The JSON of one run: lm-eval's accuracy and the direct one, and where they differ."""
    items = mc_task.items()
    by_doc = {s["doc_id"]: s for s in samples}
    rows, worst = [], 0.0
    for i, item in enumerate(items):
        served = [float(r[0][0]) for r in by_doc[i]["resps"]]
        worst = max(worst, *(abs(a - b) for a, b in zip(served, direct[i], strict=True)))
        rows.append({"doc_id": i, "answer": item["answer"], "lm_eval_pick": _argmax(served),
                     "direct_pick": _argmax(direct[i]), "lm_eval_acc": by_doc[i]["acc"]})
    acc_direct = sum(r["direct_pick"] == r["answer"] for r in rows) / len(rows)
    acc_served = summary["acc,none"]
    same_picks = sum(r["lm_eval_pick"] == r["direct_pick"] for r in rows)
    return {
        "bench": "lm-eval", "task": mc_task.TASK, "items": len(items), "model": model,
        "lm_eval": {"acc": acc_served, "acc_stderr": summary.get("acc_stderr,none"),
                    "seconds": round(lm_eval_s, 1)},
        "direct": {"acc": acc_direct},
        "same_picks": same_picks, "max_abs_loglikelihood_diff": worst,
        "passed": abs(acc_served - acc_direct) < 1e-9 and same_picks == len(items),
        "per_item": rows,
    }


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)  # the first of equal values, as lm-eval


def direct_loglikelihoods(items: list[dict[str, Any]]) -> list[list[float]]:
    """Each item's choices' loglikelihoods from a dense forward of the default model in this
    process, over the token ids lm-eval sends (its `_encode_pair` split)."""
    import jax
    import jax.numpy as jnp

    from engine.model import gemma
    from engine.model.tokenizer import Tokenizer
    from engine.model.weights import load_model

    cfg, params = load_model(None, "float32")
    params = gemma.unstack_layers(params)
    tok = Tokenizer.from_gguf()

    @jax.jit
    def scored(ids, at, nxt):
        """Sum over the positions `at` [SCORED] (-1: none) of the log-softmax of the token `nxt`."""
        T = ids.shape[0]
        pos = jnp.where(ids >= 0, jnp.arange(T), -1)[None]

        def empty(kind, index):
            kv = jnp.zeros((1, 0, cfg.n_kv_heads, cfg.head_dim), jnp.float32)
            return gemma.KVView(kv, kv, jnp.zeros((1, 0), jnp.int32))

        h, _, _ = gemma.forward(cfg, params, jnp.maximum(ids, 0)[None], pos, empty)
        lp = jax.nn.log_softmax(gemma.logits(params, h[0, jnp.maximum(at, 0)]), axis=-1)
        return jnp.sum(jnp.where(at >= 0, jnp.take_along_axis(lp, nxt[:, None], axis=1)[:, 0], 0.0))

    out = []
    for n, item in enumerate(items):
        scores = []
        for choice in item["choices"]:
            ctx, cont = encode_pair(tok, mc_task.context(item), " " + choice)
            ids = ctx + cont
            if len(ids) > PAD_TO or len(cont) > SCORED:
                raise ValueError(f"item {n}: {len(ids)} tokens, {len(cont)} to score: "
                                 f"more than {PAD_TO}, {SCORED}")
            spare = [-1] * (SCORED - len(cont))
            at = [len(ctx) - 1 + j for j in range(len(cont))] + spare  # position p predicts ids[p + 1]
            padded = jnp.asarray(ids + [-1] * (PAD_TO - len(ids)), jnp.int32)
            nxt = jnp.asarray(cont + [0] * len(spare), jnp.int32)
            scores.append(float(scored(padded, jnp.asarray(at, jnp.int32), nxt)))
        out.append(scores)
        if n % 10 == 9:
            print(f"direct loglikelihoods: {n + 1}/{len(items)} items", file=sys.stderr, flush=True)
    return out


def encode_pair(tok: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a (context, continuation) pair into token ids: trailing spaces of the
    context move to the continuation; the whole is encoded and the context's ids cut from it."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tok.encode(context + continuation, add_bos=False)
    ctx = tok.encode(context, add_bos=False)
    return ctx, whole[len(ctx):]


def _lm_eval(exe: str, base: str, model: str, task: Path, out: Path, batch_size: int,
             api_key: str | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run lm-eval on the task (its progress to stderr); (the logged samples, the task's results)."""
    args = (f"model={model},base_url={base}/v1/completions,tokenizer_backend=remote,"
            "num_concurrent=1,max_retries=1")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}  # the task is local
    if api_key:
        env["OPENAI_API_KEY"] = api_key
    cmd = [exe, "run", "--model", "local-completions", "--model_args", args, "--tasks", mc_task.TASK,
           "--include_path", ".", "--output_path", str(out), "--log_samples", "--batch_size", str(batch_size)]
    done = subprocess.run(cmd, cwd=task, env=env, stdout=sys.stderr, stderr=sys.stderr, check=False)
    if done.returncode:
        raise RuntimeError(f"lm-eval exited {done.returncode}: {' '.join(cmd)}")
    samples = [json.loads(line) for f in out.rglob(f"samples_{mc_task.TASK}_*.jsonl") for line in f.open()]
    (results,) = list(out.rglob("results_*.json"))
    return samples, json.loads(results.read_text())["results"][mc_task.TASK]


if __name__ == "__main__":
    sys.exit(main())
