"""Regenerate tests/fixtures/golden_270m.json: the independent reference that
the engine's golden test compares against.

Runs only in the dev-only reference venv (.venv-ref: torch + transformers);
the project itself never imports torch or transformers. See README.md here.

Data flow:
1. Assemble (or take) the Gemma 3 270M GGUF; hash it.
2. Read transformers' config from the GGUF and pin the Gemma 3 architecture
   facts the file does not carry (local rope base, global layers, window).
3. Load Gemma3ForCausalLM from the GGUF: float32, eager attention, CPU.
4. For each prompt (prompts.py): tokenize with transformers' GGUF tokenizer
   and require the same ids from an independent SentencePiece rebuild.
5. Greedy-decode up to N tokens, one prompt at a time, with a KV cache,
   recording per step the top-1 minus top-2 logit margin.
6. Re-score prompt + generation in one cache-free forward pass and require it
   to agree with the cached loop (checks the sliding-window cache).
7. Write the fixture (ids, margins, top-k logits, versions, config, sha256).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import re
import sys
import time
from pathlib import Path

import torch
import transformers
from prompts import Prompt, build_prompts
from sp_crosscheck import SentencePieceCrossCheck
from transformers import AutoConfig, AutoTokenizer, DynamicCache, Gemma3ForCausalLM

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_OUT = REPO_ROOT / "tests" / "fixtures" / "golden_270m.json"
NEAR_TIE = 0.005  # top-1 minus top-2 logit below this: argmax is a coin flip
TOP5_STEPS = 3  # steps whose top-5 logits are stored
TOP_PROMPT_IDS = 20  # ids whose final-prompt-position logits are stored

# Gemma 3 architecture facts (see shared FACTS.md); the rope bases and the
# global layers are not in the GGUF file, so they are pinned here.
NUM_LAYERS = 18
SLIDING_WINDOW = 512
GLOBAL_ROPE_BASE = 1_000_000.0
LOCAL_ROPE_BASE = 10_000.0
GLOBAL_LAYERS = (5, 11, 17)
QUERY_PRE_ATTN_SCALAR = 256


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", type=Path, help="GGUF file (default: the package's assemble())")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="fixture path to write")
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--only", nargs="*", help="run only these prompt names (implies --no-write)")
    p.add_argument("--no-write", action="store_true", help="print results, write nothing")
    return p.parse_args()


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def pin_architecture(config) -> dict:
    """Set the Gemma 3 facts on ``config`` (reporting any the GGUF got wrong)
    and return the summary stored in the fixture."""
    layer_types = ["full_attention" if i in GLOBAL_LAYERS else "sliding_attention"
                   for i in range(NUM_LAYERS)]
    rope = {"full_attention": {"rope_type": "default", "rope_theta": GLOBAL_ROPE_BASE},
            "sliding_attention": {"rope_type": "default", "rope_theta": LOCAL_ROPE_BASE}}
    wanted = {"num_hidden_layers": NUM_LAYERS, "sliding_window": SLIDING_WINDOW,
              "layer_types": layer_types, "rope_parameters": rope,
              "query_pre_attn_scalar": QUERY_PRE_ATTN_SCALAR, "tie_word_embeddings": True,
              "final_logit_softcapping": None, "attn_logit_softcapping": None}
    for key, value in wanted.items():
        if getattr(config, key, None) != value:
            print(f"  config fix: {key}: {getattr(config, key, None)!r} -> {value!r}")
            setattr(config, key, value)
    return {
        "model_type": config.model_type,
        "num_hidden_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "sliding_window": config.sliding_window,
        "sliding_window_semantics": "query at position q attends keys k with q-512 < k <= q",
        "rope_theta_global": GLOBAL_ROPE_BASE,
        "rope_theta_local": LOCAL_ROPE_BASE,
        "global_layers": list(GLOBAL_LAYERS),
        "layer_types": config.layer_types,
        "query_pre_attn_scalar": config.query_pre_attn_scalar,
        "rms_norm_eps": config.rms_norm_eps,
        "hidden_activation": config.hidden_activation,
        "tie_word_embeddings": config.tie_word_embeddings,
        "final_logit_softcapping": config.final_logit_softcapping,
        "attn_implementation": "eager",
        "dtype": "float32",
        "device": "cpu",
    }


def tokenize(tok, sp: SentencePieceCrossCheck, prompt: Prompt) -> list[int]:
    """Prompt ids from transformers' tokenizer, checked against SentencePiece."""
    ids = tok(prompt.text, add_special_tokens=prompt.add_bos).input_ids
    if ids[0] != tok.bos_token_id or tok.bos_token_id in ids[1:]:
        raise ValueError(f"{prompt.name}: ids must start with exactly one BOS: {ids[:5]}")
    other = sp.encode(prompt.text, add_bos=prompt.add_bos)
    if other != ids:
        first = next(i for i, (a, b) in enumerate(zip(ids + [-1], other + [-1])) if a != b)
        raise ValueError(f"{prompt.name}: transformers and SentencePiece disagree at "
                         f"index {first}: {ids[first:first + 5]} vs {other[first:first + 5]}")
    return ids


@torch.inference_mode()
def greedy_with_cache(model, ids: list[int], max_new: int, eos: int):
    """Greedy decode with a KV cache. Returns the new ids and the float32
    logits that chose each one ([steps, vocab]). Stops after EOS."""
    cache = DynamicCache(config=model.config)
    out = model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True, logits_to_keep=1)
    generated, step_logits = [], []
    for _ in range(max_new):
        logits = out.logits[0, -1].float()
        step_logits.append(logits)
        nxt = int(torch.argmax(logits))  # exact ties go to the lowest id
        generated.append(nxt)
        if nxt == eos or len(generated) == max_new:
            break
        out = model(input_ids=torch.tensor([[nxt]]), cache=cache, use_cache=True)
    return generated, torch.stack(step_logits)


@torch.inference_mode()
def teacher_forced_logits(model, ids: list[int], generated: list[int]) -> torch.Tensor:
    """Logits for every generated step from one forward pass without a cache."""
    full = torch.tensor([ids + generated[:-1]])
    out = model(input_ids=full, use_cache=False, logits_to_keep=len(generated))
    return out.logits[0].float()


def floats(t: torch.Tensor) -> list[float]:
    return [float(x) for x in t.tolist()]


def run_case(model, tok, sp, prompt: Prompt, max_new: int) -> dict:
    ids = tokenize(tok, sp, prompt)
    t0 = time.perf_counter()
    generated, logits = greedy_with_cache(model, ids, max_new, tok.eos_token_id)
    t1 = time.perf_counter()
    top2 = torch.topk(logits, 2, dim=-1)
    margins = floats(top2.values[:, 0] - top2.values[:, 1])
    near = [i for i, m in enumerate(margins) if m < NEAR_TIE]

    forced = teacher_forced_logits(model, ids, generated)
    diff = float((forced - logits).abs().max())
    forced_argmax = forced.argmax(-1).tolist()
    mismatch = [i for i, (a, b) in enumerate(zip(forced_argmax, generated)) if a != b]
    if any(margins[i] > 2 * diff for i in mismatch):
        raise RuntimeError(f"{prompt.name}: cached and cache-free greedy disagree at "
                           f"steps {mismatch} beyond the logit noise {diff:.2e}")

    top5 = torch.topk(logits[:TOP5_STEPS], 5, dim=-1)
    top20 = torch.topk(logits[0], TOP_PROMPT_IDS)
    print(f"  {prompt.name:24s} prompt {len(ids):4d} ids, {len(generated)} new in "
          f"{t1 - t0:5.1f}s, min margin {min(margins):.4f}, near-ties at {near or '-'}, "
          f"cache vs no-cache max |dlogit| {diff:.1e}")
    return {
        "name": prompt.name,
        "kind": prompt.kind,
        "text": prompt.text,
        "add_bos": prompt.add_bos,
        "prompt_len": len(ids),
        "prompt_ids": ids,
        "generated_ids": generated,
        "generated_text": tok.decode(generated),
        "stopped_at_eos": generated[-1] == tok.eos_token_id,
        "margins": margins,
        "runner_up_ids": top2.indices[:, 1].tolist(),
        "near_tie_steps": near,
        "first_near_tie_step": near[0] if near else None,
        "top5_first_steps": [{"ids": top5.indices[i].tolist(), "logits": floats(top5.values[i])}
                             for i in range(len(top5.indices))],
        "prompt_last_logits_top20": {"ids": top20.indices.tolist(),
                                     "logits": floats(top20.values)},
        "no_cache_check": {"max_abs_logit_diff": diff, "argmax_mismatch_steps": mismatch},
    }


def compact_json(obj) -> str:
    """Indented JSON with lists of numbers or of short names kept on one line."""
    text = json.dumps(obj, indent=2, ensure_ascii=False)
    return re.sub(r'\[\s*([-+0-9.eE,\s]*?|(?:"[a-z_]*",?\s*)*)\s*\]',
                  lambda m: "[" + re.sub(r",\s+", ", ", m.group(1).strip()) + "]", text)


def main() -> int:
    args = parse_args()
    sys.path.append(str(REPO_ROOT))  # the reference venv does not install this project
    from bench.hf_baseline import reference_setup

    gguf = reference_setup(args.threads, args.gguf).resolve()
    print(f"GGUF {gguf}")
    digest = sha256_of(gguf)

    print("loading config, tokenizer and model from the GGUF (about a minute) ...")
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    arch = pin_architecture(config)
    print("config used:\n" + compact_json(arch))
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = Gemma3ForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, config=config,
        dtype=torch.float32, attn_implementation="eager").eval()
    sp = SentencePieceCrossCheck(str(gguf))

    count = lambda text: len(tok(text).input_ids)
    prompts = build_prompts(count)
    if args.only:
        prompts = [p for p in prompts if p.name in args.only]
        args.no_write = True
    print(f"generating {args.max_new_tokens} greedy tokens for {len(prompts)} prompts:")
    cases = [run_case(model, tok, sp, p, args.max_new_tokens) for p in prompts]

    fixture = {
        "schema_version": 1,
        "generator": "tests/engine/golden/make_golden.py",
        "model": {"file": gguf.name, "sha256": digest, "size_bytes": gguf.stat().st_size},
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                     "python": platform.python_version()},
        "hf_config": arch,
        "settings": {"max_new_tokens": args.max_new_tokens, "greedy": True,
                     "stop_at_eos_id": tok.eos_token_id, "argmax_tie_break": "lowest id",
                     "near_tie_margin": NEAR_TIE, "top5_steps": TOP5_STEPS,
                     "prompt_logit_ids": TOP_PROMPT_IDS},
        "cases": cases,
    }
    if args.no_write:
        print("(not written)")
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(compact_json(fixture) + "\n", encoding="utf-8")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
