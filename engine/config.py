"""Static configuration of the engine: model architecture and serving knobs.

Everything here is a frozen, hashable dataclass, so it can be a static
argument of `jax.jit`. Per-step values never live here: as arrays they never
trigger a recompile.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

WEIGHT_FORMS = ("gguf", "int8", "bfloat16", "float32")
"""How the weights are served (`--weights`): a GGUF's own quantized blocks, int8 with a scale per
output column, or float matrices (engine/model/quant_weights.py)."""
QUANTIZED_FORMS = ("gguf", "int8")
"""The forms whose matrices run through the quantized matmul (engine/quant/)."""

@dataclass(frozen=True)
class ModelConfig:
    """The Gemma 3 text architecture (decoder only)."""

    name: str = "gemma3-270m"
    vocab_size: int = 262_144
    """Rows of the (tied) embedding table."""
    d_model: int = 640
    """Width of the residual stream."""
    n_layers: int = 18
    """Number of transformer blocks."""
    n_heads: int = 4
    """Query heads per layer."""
    n_kv_heads: int = 1
    """Key/value heads per layer (grouped-query attention)."""
    head_dim: int = 256
    """Width of one attention head."""
    ffn_dim: int = 2048
    """Hidden width of the GeGLU MLP."""
    sliding_window: int = 512
    """Tokens a local (sliding-window) layer attends to, itself included."""
    global_every: int = 6
    """Layer i is global when (i + 1) % global_every == 0; the rest are local."""
    rope_base_global: float = 1_000_000.0
    """RoPE base frequency of the global layers."""
    rope_base_local: float = 10_000.0
    """RoPE base frequency of the local layers."""
    rope_scale_global: float = 1.0
    """Linear RoPE position scaling of the global layers (8.0 on 4B and up)."""
    rms_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    query_pre_attn_scalar: float = 256.0
    """Attention logits are scaled by query_pre_attn_scalar ** -0.5."""
    max_position: int = 32_768
    """Longest context the model was trained for."""
    bos_id: int = 2
    eos_id: int = 1
    pad_id: int = 0
    end_of_turn_id: int = 106
    start_of_turn_id: int = 105

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}"
            )
        if self.sliding_window <= 0:
            raise ValueError(f"sliding_window={self.sliding_window} must be positive")

    def is_global(self, layer: int) -> bool:
        """Whether `layer` attends to the whole context (True) or a window."""
        return (layer + 1) % self.global_every == 0

    @property
    def global_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.n_layers) if self.is_global(i))

    @property
    def local_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.n_layers) if not self.is_global(i))

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def param_count(self) -> int:
        """Parameters, counting the tied embedding once."""
        d, f = self.d_model, self.ffn_dim
        per_layer = (
            d * (self.q_dim + 2 * self.kv_dim)  # q, k, v
            + self.q_dim * d  # o
            + 3 * d * f  # gate, up, down
            + 4 * d  # four norms
            + 2 * self.head_dim  # q_norm, k_norm
        )
        return self.vocab_size * d + self.n_layers * per_layer + d

    def replace(self, **kw) -> ModelConfig:
        return dataclasses.replace(self, **kw)


GEMMA3_270M = ModelConfig()
GEMMA3_1B = ModelConfig(
    name="gemma3-1b", d_model=1152, n_layers=26, n_heads=4, n_kv_heads=1,
    head_dim=256, ffn_dim=6912, sliding_window=512,
)
GEMMA3_4B = ModelConfig(
    name="gemma3-4b", d_model=2560, n_layers=34, n_heads=8, n_kv_heads=4,
    head_dim=256, ffn_dim=10240, sliding_window=1024, rope_scale_global=8.0,
    max_position=131_072,
)
GEMMA3_12B = ModelConfig(
    name="gemma3-12b", d_model=3840, n_layers=48, n_heads=16, n_kv_heads=8,
    head_dim=256, ffn_dim=15360, sliding_window=1024, rope_scale_global=8.0,
    max_position=131_072,
)
GEMMA3_27B = ModelConfig(
    name="gemma3-27b", d_model=5376, n_layers=62, n_heads=32, n_kv_heads=16,
    head_dim=128, ffn_dim=21504, sliding_window=1024, rope_scale_global=8.0,
    query_pre_attn_scalar=168.0, max_position=131_072,
)
PRESETS: dict[str, ModelConfig] = {
    c.name: c for c in (GEMMA3_270M, GEMMA3_1B, GEMMA3_4B, GEMMA3_12B, GEMMA3_27B)
}
