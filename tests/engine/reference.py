"""An independent dense reference of Gemma 3 for tests: no pages, no scan.

Written as plainly as possible (numpy, one layer at a time, full attention
matrix with explicit causal and sliding-window masks) so that it shares no code
with engine/model/gemma.py beyond the params layout.
"""

from __future__ import annotations

import math

import numpy as np

from engine.config import ModelConfig


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, base, scale):
    T, _, hd = x.shape
    half = hd // 2
    inv = 1.0 / base ** (np.arange(half) * 2.0 / hd)
    ang = (np.arange(T)[:, None] / scale) * inv[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def dense_logits(cfg: ModelConfig, params, tokens: list[int]) -> np.ndarray:
    """Logits [T, vocab] for one sequence, float64."""
    P = {k: np.asarray(v, np.float64) for k, v in params.items() if k != "layers"}
    Ls = {k: np.asarray(v, np.float64) for k, v in params["layers"].items()}
    T = len(tokens)
    x = P["embed"][tokens] * math.sqrt(cfg.d_model)
    i = np.arange(T)
    for l in range(cfg.n_layers):
        glob = cfg.is_global(l)
        h = _rms(x, Ls["attn_norm"][l], cfg.rms_eps)
        qkv = h @ Ls["qkv"][l]
        q = qkv[:, : cfg.q_dim].reshape(T, cfg.n_heads, cfg.head_dim)
        k = qkv[:, cfg.q_dim : cfg.q_dim + cfg.kv_dim].reshape(T, cfg.n_kv_heads, cfg.head_dim)
        v = qkv[:, cfg.q_dim + cfg.kv_dim :].reshape(T, cfg.n_kv_heads, cfg.head_dim)
        q = _rms(q, Ls["q_norm"][l], cfg.rms_eps)
        k = _rms(k, Ls["k_norm"][l], cfg.rms_eps)
        base = cfg.rope_base_global if glob else cfg.rope_base_local
        scale = cfg.rope_scale_global if glob else 1.0
        q, k = _rope(q, base, scale), _rope(k, base, scale)
        mask = i[None, :] <= i[:, None]
        if not glob:
            mask &= (i[:, None] - i[None, :]) < cfg.sliding_window
        rep = cfg.n_heads // cfg.n_kv_heads
        out = np.zeros((T, cfg.n_heads, cfg.head_dim))
        for hh in range(cfg.n_heads):
            kh = hh // rep
            s = (q[:, hh] @ k[:, kh].T) * cfg.query_pre_attn_scalar ** -0.5
            s = np.where(mask, s, -np.inf)
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            s /= s.sum(axis=-1, keepdims=True)
            out[:, hh] = s @ v[:, kh]
        a = out.reshape(T, cfg.q_dim) @ Ls["o"][l]
        x = x + _rms(a, Ls["post_attn_norm"][l], cfg.rms_eps)
        h = _rms(x, Ls["pre_ffw_norm"][l], cfg.rms_eps)
        gu = h @ Ls["gate_up"][l]
        m = (_gelu_tanh(gu[:, : cfg.ffn_dim]) * gu[:, cfg.ffn_dim :]) @ Ls["down"][l]
        x = x + _rms(m, Ls["post_ffw_norm"][l], cfg.rms_eps)
    x = _rms(x, P["final_norm"], cfg.rms_eps)
    return x @ P["embed"].T
