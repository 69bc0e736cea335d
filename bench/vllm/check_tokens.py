"""Dev-only: do the converted folder's tokenizer and chat template give crossover's token ids?

Run with the vLLM venv's python after convert.py:

    ~/.cache/crossover/vllm-venv/bin/python bench/vllm/check_tokens.py [--model DIR]

1. Texts and conversations below go, as JSON on stdin, to the project's own
   python (`--project-python`, default .venv/bin/python of this checkout),
   which encodes them with engine.model.tokenizer.Tokenizer: `encode` (BOS added,
   as /v1/completions does) and `encode_chat` (as /v1/chat/completions does).
2. The folder's tokenizer encodes the same with transformers (BOS by the
   tokenizer; chats through its chat template, tokenized as vLLM does: the
   rendered text, `<bos>` written by the template, no special tokens added).
3. Each pair is printed; the exit status is 1 if any differ.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"

from transformers import AutoTokenizer

REPO = Path(__file__).resolve().parents[2]
TEXTS = [
    "The capital of France is",
    "Hello, world!",
    "  two leading spaces and  a double space",
    "line one\nline two\n\n\tindented with a tab",
    "def f(x):\n    return x ** 2  # four-space indent\n",
    "Unicode: café, naïve, 東京, emoji 🤖🚀",
    "<start_of_turn>user\nraw template text<end_of_turn>\n<start_of_turn>model\n",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  Hi there \n"}],
    [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": [{"type": "text", "text": "Another one?"}]}],
]
PROJECT_SIDE = """
import json, sys
from engine.model.tokenizer import Tokenizer
tok = Tokenizer.from_gguf(progress=False)
job = json.load(sys.stdin)
json.dump({"texts": [tok.encode(t) for t in job["texts"]],
           "chats": [tok.encode_chat(c) for c in job["chats"]],
           "rendered": [tok.apply_chat_template(c) for c in job["chats"]]}, sys.stdout)
"""


def project_ids(python: Path) -> dict:
    job = json.dumps({"texts": TEXTS, "chats": CHATS})
    done = subprocess.run([str(python), "-c", PROJECT_SIDE], input=job, capture_output=True,
                          text=True, cwd=REPO, check=False)
    if done.returncode:
        sys.exit(f"the project's tokenizer failed:\n{done.stderr}")
    return json.loads(done.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=Path(os.environ.get(
        "VLLM_MODEL", Path.home() / ".cache" / "crossover" / "vllm-model")))
    p.add_argument("--project-python", type=Path, default=REPO / ".venv" / "bin" / "python")
    args = p.parse_args()
    ours = project_ids(args.project_python)
    hf = AutoTokenizer.from_pretrained(args.model)
    pairs = [(repr(t), ours["texts"][i], hf(t).input_ids) for i, t in enumerate(TEXTS)]
    for i, chat in enumerate(CHATS):
        rendered = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        if rendered != "<bos>" + ours["rendered"][i]:
            print(f"chat {i}: rendered text differs:\n  hf:      {rendered!r}\n"
                  f"  project: {ours['rendered'][i]!r}")
        pairs.append((f"chat {i}", ours["chats"][i], hf(rendered, add_special_tokens=False).input_ids))
    bad = 0
    for name, want, got in pairs:
        same = want == got
        bad += not same
        detail = "" if same else f"\n  project: {want}\n  hf:      {got}"
        print(f"{'same' if same else 'DIFFERENT'}  {name}: {len(want)} ids{detail}")
    print(f"{len(pairs) - bad} of {len(pairs)} identical")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
