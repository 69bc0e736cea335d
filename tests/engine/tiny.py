"""A tiny Gemma-3-shaped model for fast engine tests: its config and random weights."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from engine.config import ModelConfig
from engine.model.gemma import Params


def tiny_config(**kw) -> ModelConfig:
    """A small config for fast unit tests.

    7 layers: two groups of (local, local, global), then one trailing local.
    """
    base = dict(
        name="tiny", vocab_size=512, d_model=64, n_layers=7, n_heads=4, n_kv_heads=2, global_every=3,
        head_dim=16, ffn_dim=128, sliding_window=8, query_pre_attn_scalar=16.0,
        max_position=4096,
    )
    base.update(kw)
    return ModelConfig(**base)


def init_random_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32) -> Params:
    """Random weights with Gemma 3's shapes (norm multipliers near 1)."""
    L, d, f = cfg.n_layers, cfg.d_model, cfg.ffn_dim
    ks = iter(jax.random.split(key, 16))

    def mat(*shape, fan_in):
        return (jax.random.normal(next(ks), shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype)

    def norm(*shape):
        return (1.0 + 0.1 * jax.random.normal(next(ks), shape, jnp.float32)).astype(dtype)

    return {
        "embed": mat(cfg.vocab_size, d, fan_in=d),
        "final_norm": norm(d),
        "layers": {
            "attn_norm": norm(L, d),
            "qkv": mat(L, d, cfg.q_dim + 2 * cfg.kv_dim, fan_in=d),
            "q_norm": norm(L, cfg.head_dim),
            "k_norm": norm(L, cfg.head_dim),
            "o": mat(L, cfg.q_dim, d, fan_in=cfg.q_dim),
            "post_attn_norm": norm(L, d),
            "pre_ffw_norm": norm(L, d),
            "gate_up": mat(L, d, 2 * f, fan_in=d),
            "down": mat(L, f, d, fan_in=f),
            "post_ffw_norm": norm(L, d),
        },
    }
