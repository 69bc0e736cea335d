"""A small multiple-choice task for lm-eval (`crossover bench lm-eval`), made here and committed
under bench/workloads/lm_eval_mc/: 60 questions (capitals, arithmetic, opposites), four choices
each, the answer's place drawn with a fixed seed. `python -m bench.workloads.mc_task` writes the
task's YAML and JSONL again; a test checks the committed files equal what this makes.

The prompt starts with Gemma's `<bos>` written out: lm-eval's remote tokenizer asks the daemon's
/tokenize for ids with no special tokens added, and the model is trained to read BOS first.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

TASK = "crossover_mc"
FOLDER = Path(__file__).with_name("lm_eval_mc")

CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("Japan", "Tokyo"), ("China", "Beijing"), ("Russia", "Moscow"), ("Egypt", "Cairo"),
    ("Canada", "Ottawa"), ("Australia", "Canberra"), ("Brazil", "Brasilia"), ("India", "New Delhi"),
    ("Mexico", "Mexico City"), ("Greece", "Athens"), ("Portugal", "Lisbon"), ("Norway", "Oslo"),
    ("Sweden", "Stockholm"), ("Poland", "Warsaw"), ("Austria", "Vienna"), ("Ireland", "Dublin"),
]
OPPOSITES = [
    ("hot", "cold"), ("up", "down"), ("big", "small"), ("fast", "slow"), ("light", "dark"),
    ("happy", "sad"), ("open", "closed"), ("early", "late"), ("rich", "poor"), ("full", "empty"),
    ("old", "young"), ("hard", "soft"), ("wet", "dry"), ("strong", "weak"), ("high", "low"),
    ("loud", "quiet"), ("thick", "thin"), ("first", "last"), ("inside", "outside"), ("win", "lose"),
]
ARITHMETIC = 20
"""Sums of two numbers under 20."""
CONTEXT = "<bos>Question: {question}\nAnswer:"
"""What each choice is conditioned on (lm-eval's doc_to_text, in Jinja there)."""


def items(seed: int = 0) -> list[dict[str, Any]]:
    """The task's questions: {"question", "choices" (four), "answer" (the right choice's index)}."""
    rng = random.Random(seed)
    out = []
    for country, city in CAPITALS:
        wrong = rng.sample([c for _, c in CAPITALS if c != city], 3)
        out.append(_item(rng, f"What is the capital of {country}?", city, wrong))
    for word, opposite in OPPOSITES:
        wrong = rng.sample([o for _, o in OPPOSITES if o != opposite], 3)
        out.append(_item(rng, f"What is the opposite of {word}?", opposite, wrong))
    for _ in range(ARITHMETIC):
        a, b = rng.randint(1, 19), rng.randint(1, 19)
        wrong = rng.sample([n for n in range(a + b - 5, a + b + 6) if n != a + b and n > 0], 3)
        out.append(_item(rng, f"What is {a} plus {b}?", str(a + b), [str(n) for n in wrong]))
    return out


def _item(rng: random.Random, question: str, right: str, wrong: list[str]) -> dict[str, Any]:
    at = rng.randrange(4)
    return {"question": question, "choices": wrong[:at] + [right] + wrong[at:], "answer": at}


def task_yaml() -> str:
    """lm-eval's task configuration (the data file relative to the folder lm-eval runs in)."""
    return "\n".join([
        f"task: {TASK}",
        "dataset_path: json",
        "dataset_kwargs:",
        "  data_files:",
        f"    test: {TASK}.jsonl",
        "test_split: test",
        "output_type: multiple_choice",
        "doc_to_text: " + json.dumps(CONTEXT.replace("{question}", "{{question}}")),
        "doc_to_choice: choices",
        "doc_to_target: answer",
        "metric_list:",
        "  - metric: acc",
        "    aggregation: mean",
        "    higher_is_better: true",
        "metadata:",
        "  version: 1",
        "",
    ])


def context(item: dict[str, Any]) -> str:
    """The text lm-eval conditions each choice on (the YAML's doc_to_text)."""
    return CONTEXT.format(question=item["question"])


def files() -> dict[str, str]:
    """Each file of the task folder and its text."""
    lines = "".join(json.dumps(item) + "\n" for item in items())
    return {f"{TASK}.yaml": task_yaml(), f"{TASK}.jsonl": lines}


def write(folder: Path = FOLDER) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files().items():
        (folder / name).write_text(text)


if __name__ == "__main__":
    write()
    print(f"wrote {len(items())} items to {FOLDER}")
