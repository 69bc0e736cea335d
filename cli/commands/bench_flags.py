"""Flags several `crossover bench` commands share: the engine to load, the policies to run."""

from __future__ import annotations

from typing import Any


def add_engine(add: Any, *, heads: bool, sized: bool) -> None:
    """The engine flags of `bench serve|crossover|tuner`: --model, --heads (with `heads`), --dtype
    and, with `sized`, --max-batch, --max-context, --fake."""
    add("--model", default=None, help="a .gguf file or a HF Gemma 3 directory (default: Gemma 3 270M)")
    if heads:
        add("--heads", default=None, help="a crossover train-heads file (default: the one train-heads "
                                          "wrote to the user cache, else the model's shipped one)")
    add("--dtype", default=None, choices=["float32", "bfloat16"])
    if sized:
        add("--max-batch", type=int, default=32, help="the engine's most sequences decoded together")
        add("--max-context", type=int, default=None,
            help="the engine's context in tokens (default 1024; bench serve --shared-prefix: 2048)")
        add("--fake", action="store_true", help="use the fake engine (no model; for tests)")


def add_policies(add: Any, *, techniques: str, depths: str, depths_help: str, pool_split_help: str) -> None:
    """--techniques, --depths, --pool-split: the policies `bench crossover` and `bench tuner` run
    (`techniques` says what the techniques are for; default: every proposer loaded)."""
    add("--techniques", default=None, help=f"{techniques} (default: every one loaded)")
    add("--depths", default=depths, help=depths_help)
    add("--pool-split", type=float, default=0.25, help=pool_split_help)
