"""Tensor parallelism: place the params and the KV pools over a 1-D device mesh.

The model code stays as it is: arrays carry a `NamedSharding` over a mesh
with one axis, "tp", and XLA's SPMD partitioner splits every jitted
computation that reads them and inserts the collectives (all-reduce after a
row-split matmul, all-gather where a full array is needed). Layout:

- attention: query projection split by heads (columns), output projection by
  its rows (the same heads); key/value projections split by heads when the
  KV heads divide evenly over the mesh, else replicated (Gemma 3 270M has 1);
- MLP: gate and up split by columns, down by rows;
- embedding / tied output layer [vocab, d]: split along the vocabulary;
- KV pools [layers, pages, page, kv_heads, hd]: split along kv_heads when
  they divide evenly, else replicated (every device holds the whole pool);
- norms: replicated.

Fused weights (`qkv`, `gate_up`) are split into separate matrices first, so
each device holds whole heads and matching gate/up columns; engine.model.gemma's
`block` accepts either form.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from engine.config import ModelConfig

AXIS = "tp"


def make_mesh(n: int) -> Mesh:
    """A mesh of the first `n` devices on one "tp" axis (all hosts' devices after
    `jax.distributed.initialize`)."""
    devices = jax.devices()
    if n < 1 or n > len(devices):
        raise ValueError(f"tensor_parallel={n} needs {n} devices; {len(devices)} available "
                         f"({jax.default_backend()}); on CPU set "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={n}")
    return Mesh(np.array(devices[:n]), (AXIS,))


def _split(n_units: int, mesh: Mesh) -> bool:
    """Whether `n_units` (heads, columns, rows) divide evenly over the mesh."""
    return n_units % mesh.shape[AXIS] == 0


def unfuse_layer(cfg: ModelConfig, lp: dict) -> dict:
    """One layer's weights with `qkv` split into q, k, v and `gate_up` into gate, up."""
    out = dict(lp)
    if "qkv" in out:
        qkv = out.pop("qkv")
        out["q"], out["k"], out["v"] = (qkv[:, : cfg.q_dim], qkv[:, cfg.q_dim : cfg.q_dim + cfg.kv_dim],
                                        qkv[:, cfg.q_dim + cfg.kv_dim :])
    if "gate_up" in out:
        gate_up = out.pop("gate_up")
        out["gate"], out["up"] = gate_up[:, : cfg.ffn_dim], gate_up[:, cfg.ffn_dim :]
    return out


def layer_specs(cfg: ModelConfig, mesh: Mesh) -> dict[str, P]:
    """PartitionSpec of each (unfused) per-layer weight."""
    heads = P(None, AXIS) if _split(cfg.n_heads, mesh) else P()
    kv = P(None, AXIS) if _split(cfg.n_kv_heads, mesh) else P()
    ffn = _split(cfg.ffn_dim, mesh)
    return {"q": heads, "k": kv, "v": kv, "o": P(AXIS, None) if heads != P() else P(),
            "gate": P(None, AXIS) if ffn else P(), "up": P(None, AXIS) if ffn else P(),
            "down": P(AXIS, None) if ffn else P()}


def shard_params(cfg: ModelConfig, params: dict, mesh: Mesh) -> dict:
    """`params` (per-layer list, see engine.model.gemma.unstack_layers) placed over `mesh`."""
    specs = layer_specs(cfg, mesh)

    def put(a, spec):
        return jax.device_put(a, NamedSharding(mesh, spec))

    vocab = P(AXIS, None) if _split(params["embed"].shape[0], mesh) else P()
    out = {k: put(v, vocab if k in ("embed", "embed_fast") else P()) for k, v in params.items()
           if k != "layers"}
    out["layers"] = [{k: put(v, specs.get(k, P())) for k, v in unfuse_layer(cfg, lp).items()}
                     for lp in params["layers"]]
    return out


def kv_sharding(cfg: ModelConfig, mesh: Mesh) -> NamedSharding:
    """Sharding of every KV pool array [layers, pages, page, kv_heads, hd]."""
    spec = P(None, None, None, AXIS, None) if _split(cfg.n_kv_heads, mesh) else P()
    return NamedSharding(mesh, spec)


def shard_kv(cfg: ModelConfig, kv, mesh: Mesh):
    """The KV state (engine.memory.kv.KVState) placed over `mesh`."""
    s = kv_sharding(cfg, mesh)
    return jax.tree.map(lambda a: jax.device_put(a, s), kv)


def per_device_fraction(n_units: int, n: int) -> float:
    """Share of an array each of `n` devices holds when split along `n_units` (1.0: replicated).

    Example: per_device_fraction(4, 2) == 0.5; per_device_fraction(1, 2) == 1.0.
    """
    return 1.0 / n if n > 1 and n_units % n == 0 else 1.0
