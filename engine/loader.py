"""Build a ready EngineCore from a model spec: weights, tokenizer, planned KV pool.

Default compute dtype per backend: float32 on CPU, bfloat16 on TPU/GPU.
XLA:CPU has no native bfloat16 matrix-vector product on most hosts (it widens
each operand to float32 first), so at small batches a bfloat16 engine does
more work than a float32 one, which already streams the weights at the read
bandwidth. Accelerators have native bf16 units and half the bytes to read,
so bf16 is faster there.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from engine.config import QUANTIZED_FORMS, WEIGHT_FORMS, ModelConfig
from engine.execute.runner import RunnerConfig
from engine.memory import sizes
from engine.memory.budget import heads_resident_bytes
from engine.memory.sizes import KV_DTYPE_BYTES, size_pool
from engine.model.quant_weights import is_gguf
from engine.runtime.compiles import enable_persistent_cache
from engine.runtime.progress import Reporter, note
from engine.speculation.layer_draft import DRAFT_VOCABS
from engine.step.core import EngineConfig, EngineCore

PAGE_SIZE = 16
MAX_SPEC_DEPTH = 8
DEFAULT_KV_BUDGET = {"cpu": 2 << 30}
"""Bytes of KV pool and speculation beside weights in the backend's default dtype, when no budget
is given (elsewhere 4 GiB): `default_memory_budget` adds those weights' bytes."""


def default_dtype() -> str:
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def default_weights(model: str | Path | None) -> str:
    """The weights form served when neither --weights nor --dtype is given: a GGUF model's own
    blocks ("gguf") on the CPU, where the quantized-matmul kernel runs; elsewhere, or for a
    checkpoint directory, the backend's default dtype (the kernel is CPU-only, and qmatmul's jnp
    path would rebuild every float matrix on every call)."""
    return "gguf" if jax.default_backend() == "cpu" and is_gguf(model) else default_dtype()


def default_memory_budget(cfg: ModelConfig) -> int:
    """The memory budget (weights + speculation + KV pool) when none is given: DEFAULT_KV_BUDGET
    beside the model's weights in the backend's default dtype. Weights held in that dtype keep
    the default pool; weights held in fewer bytes (gguf, int8) leave the difference to the pool.

    >>> from engine.config import GEMMA3_270M
    >>> default_memory_budget(GEMMA3_270M) == (2 << 30) + 4 * GEMMA3_270M.param_count()  # CPU
    True
    """
    return DEFAULT_KV_BUDGET.get(jax.default_backend(), 4 << 30) + sizes.weight_bytes(cfg.param_count(),
                                                                                     default_dtype())


MAX_CHUNK = 512
"""Most tokens of one prompt a step prefills (capped by the local ring: RunnerConfig)."""


MODEL_PROPOSERS = ("mtp", "early_exit", "draft")
"""The proposers a heads file provides (n-gram needs none)."""
VERIFY_TOKENS = (2, 3, 5, 9)
"""Verify buckets (1 + depth) compiled when speculation is on: depths 1, 2, 3-4, 5-8."""
SPEC_MAX_BATCH = 16
"""Largest decode batch compiled for verification by default (speculation stops paying beyond).
Above it every step decodes plainly: a policy speculating there is served clamped, visibly
(engine.step.chooser.StepChooser.clamped, /ready's engine.speculation), and the tuner's search space
offers no crossover above it (tuner/space.py)."""


def runner_config(cfg: ModelConfig, dtype: str, kv_budget_bytes: int, max_batch: int,
                  max_context: int, kv_dtype: str | None = None, verify_tokens: tuple[int, ...] = (),
                  spec_max_batch: int = SPEC_MAX_BATCH, tensor_parallel: int = 1) -> RunnerConfig:
    """Size the pools with the memory planner; the page tables span max_context rounded up to a
    page (every ragged call has that one width: engine/execute/ragged_calls.py).

    `tensor_parallel`: devices the params and KV pools are split over (engine/model/sharding.py).
    """
    kv_dtype = kv_dtype or dtype
    if kv_dtype not in KV_DTYPE_BYTES:
        raise ValueError(f"kv dtype {kv_dtype!r} is not one of {sorted(KV_DTYPE_BYTES)}")
    sizes = size_pool(cfg, kv_budget_bytes, PAGE_SIZE, kv_dtype, max_context, MAX_SPEC_DEPTH)
    return RunnerConfig(
        page_size=PAGE_SIZE,
        max_batch=max_batch,
        max_chunk=min(MAX_CHUNK, sizes.ring_pages * PAGE_SIZE),
        max_context=-(-max_context // PAGE_SIZE) * PAGE_SIZE,
        global_pages=sizes.num_global_pages + 1,  # + the scratch page
        local_pages=sizes.num_local_pages + 1,
        ring_pages=sizes.ring_pages,
        dtype=dtype,
        kv_dtype=kv_dtype,
        verify_tokens=verify_tokens,
        spec_max_batch=min(spec_max_batch, max_batch),
        fast_output=dtype == "float32" and jax.default_backend() == "cpu" and cpu_has_bf16(),
        tensor_parallel=tensor_parallel,
    )


def weights_and_dtype(weights: str | None, dtype: str | None,
                      model: str | Path | None = None) -> tuple[str, str]:
    """(compute dtype, weights form) from the two flags: a float form is the dtype; a quantized
    form computes in float32; a dtype alone is the form; neither: `default_weights(model)`.

    >>> weights_and_dtype(None, None), weights_and_dtype(None, None, "/models/gemma-3-270m")  # CPU
    (('float32', 'gguf'), ('float32', 'float32'))
    >>> (weights_and_dtype(None, "float32"), weights_and_dtype("int8", None),
    ...  weights_and_dtype("bfloat16", None))
    (('float32', 'float32'), ('float32', 'int8'), ('bfloat16', 'bfloat16'))
    """
    if weights is not None and weights not in WEIGHT_FORMS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMS)}, got {weights!r}")
    if weights is None and dtype is None:
        weights = default_weights(model)
    want = "float32" if weights in QUANTIZED_FORMS else weights
    if dtype is not None and want is not None and dtype != want:
        raise ValueError(f"dtype {dtype} contradicts weights {weights} (which computes in {want})")
    dtype = dtype or want or default_dtype()
    return dtype, weights or dtype


def pool_budget(memory_budget_bytes: int, weight_bytes: int, weights: str) -> int:
    """Bytes of a memory budget left for speculation and the KV pool beside weights that hold
    `weight_bytes`; ValueError when none are.

    >>> pool_budget(3 << 30, 1 << 30, "float32") == 2 << 30
    True
    """
    left = memory_budget_bytes - weight_bytes
    if left <= 0:
        raise ValueError(f"a memory budget of {memory_budget_bytes} bytes leaves nothing for the KV "
                         f"pool beside {weight_bytes} bytes of {weights} weights")
    return left


def cpu_has_bf16() -> bool:
    """Whether the host CPU multiplies bfloat16 natively (AVX-512 BF16 or AMX BF16 in /proc/cpuinfo):
    only there may a float32 engine keep a bfloat16 copy of its output table
    (RunnerConfig.fast_output); elsewhere the float32 product is as fast or faster
    (engine.model.gemma.tied_logits) and the copy would cost a third of a gigabyte for nothing."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def load_engine(model: str | None = None, dtype: str | None = None, kv_budget_bytes: int | None = None,
                max_batch: int = 32, max_context: int = 4096, progress: Reporter = True,
                token_budget: int = 512, speculation: bool = True, heads: str | None = None,
                verify_tokens: tuple[int, ...] = VERIFY_TOKENS, spec_max_batch: int = SPEC_MAX_BATCH,
                model_proposers: tuple[str, ...] = MODEL_PROPOSERS, tensor_parallel: int = 1,
                prefix_cache: bool = True, background_warmup: bool = False,
                weights: str | None = None, memory_budget_bytes: int | None = None) -> EngineCore:
    """Load weights and tokenizer, plan the pool, and return an (unwarmed) engine.

    With `speculation`, the verify buckets are compiled and the proposers load:
    n-gram always; those of `model_proposers` (MTP heads, early exit, the draft
    model) from a `crossover train-heads` file (`find_heads`; none read when
    `model_proposers` is empty).
    `progress` (engine/runtime/progress.py): False is silent; True prints what was loaded;
    a callback also sees assembling, hashing and converting the model file.
    `tensor_parallel` > 1 splits the model and KV pools over that many devices
    (engine/model/sharding.py); a budget stays that of the whole pool.
    Memory (engine/memory/budget.py): `memory_budget_bytes` is weights + speculation + KV pool,
    so the pool gets what the served weights (their real bytes) and the proposers leave;
    `kv_budget_bytes` instead fixes speculation + KV pool alone; neither: `default_memory_budget`.
    `prefix_cache`: share the KV pages of common prompt prefixes (engine/memory/prefix_cache.py).
    `background_warmup`: `warmup()` returns once the ragged calls are compiled and the
    proposers' shapes compile on a thread (engine/warmup/warm.py; `crossover serve` does so).
    `weights` (engine/model/quant_weights.py): "gguf" serves the file's own quantized blocks,
    "int8" an int8 copy of the float weights, both through the quantized-matmul kernel (built
    here; without it, their numbers as float32), computing in float32; "float32" or "bfloat16"
    is `dtype`; None: `weights_and_dtype` (a GGUF on the CPU: "gguf").
    """
    from engine.model.gguf_file import default_gguf_path
    from engine.model.quant_weights import is_quantized, load_weights, weight_bytes
    from engine.model.tokenizer import Tokenizer

    if kv_budget_bytes is not None and memory_budget_bytes is not None:
        raise ValueError(f"give kv_budget_bytes ({kv_budget_bytes}) or memory_budget_bytes "
                         f"({memory_budget_bytes}), not both")
    enable_persistent_cache()
    if tensor_parallel != 1:
        from engine.model.sharding import make_mesh

        make_mesh(tensor_parallel)  # fail before loading weights when the devices are not there
    dtype, weights = weights_and_dtype(weights, dtype, model)
    if weights in QUANTIZED_FORMS and tensor_parallel != 1:
        raise ValueError(f"weights {weights} serve on one device; tensor parallel needs float32 or bfloat16")
    cfg, params = load_weights(model, weights, progress=progress)
    if max_context > cfg.max_position:
        raise ValueError(f"max_context={max_context} exceeds the model's max_position={cfg.max_position}")
    gguf = model if model and model.endswith(".gguf") else None
    # Every Gemma 3 size shares one 262k vocabulary: a HF directory uses the default file's.
    tokenizer = Tokenizer.from_gguf(gguf or default_gguf_path(progress), progress=progress)
    if weights in QUANTIZED_FORMS and not is_quantized(params):  # no kernel: load_weights noted why
        weights = "float32"
    held = weight_bytes(params)
    budget = kv_budget_bytes or pool_budget(memory_budget_bytes or default_memory_budget(cfg), held, weights)
    loaded = _read_heads(heads, cfg, dtype, progress) if speculation and model_proposers else None
    resident = 0 if loaded is None else heads_resident_bytes(  # one budget (engine/memory/budget.py)
        loaded[0], cfg, model_proposers, DRAFT_VOCABS, params["embed"])
    rc = runner_config(cfg, dtype, budget - resident, max_batch, max_context,
                       verify_tokens=verify_tokens if speculation else (), spec_max_batch=spec_max_batch,
                       tensor_parallel=tensor_parallel)
    note(progress, f"engine: {cfg.name} {dtype}, weights {weights} ({held / 2**20:.0f} MiB), KV pool "
                   f"{rc.global_pages - 1} global + {rc.local_pages - 1} local pages of {PAGE_SIZE} tokens "
                   f"({(budget - resident) / 2**20:.0f} MiB of a {(held + budget) / 2**20:.0f} MiB memory "
                   f"budget, speculation {resident / 2**20:.0f} MiB), max batch {max_batch}, context "
                   f"{rc.max_context}"
                   + (f", tensor parallel over {tensor_parallel} devices" if tensor_parallel > 1 else ""))
    engine = EngineCore(cfg, params, tokenizer, EngineConfig(runner=rc, token_budget=token_budget,
                                                             prefix_cache=prefix_cache,
                                                             background_warmup=background_warmup),
                        model_name=cfg.name)
    engine.budget_bytes, engine.weights_form = budget, weights
    if loaded is not None:
        _add_heads(engine, *loaded, progress, model_proposers)
    return engine


def heads_cache_path(model_name: str) -> Path:
    """Where `crossover train-heads` writes a model's heads by default: the user cache,
    `<cache_dir()>/heads/<model>.safetensors` (never the installed package)."""
    from engine.model.gguf_file import cache_dir

    return cache_dir() / "heads" / f"{model_name}.safetensors"


def find_heads(heads: str | Path | None, cfg: ModelConfig) -> tuple[Path | None, str]:
    """The heads file to load and where it came from, in this order: `heads` (given: used even if
    missing, so that loading names it), the user cache's file for the model (`heads_cache_path`),
    the file shipped in engine/data/. (None, "none") when neither default exists."""
    from engine.speculation.heads import default_heads_path

    if heads is not None:
        return Path(heads), "given"
    for path, source in ((heads_cache_path(cfg.name), "user cache"), (default_heads_path(cfg), "packaged")):
        if path.is_file():
            return path, source
    return None, "none"


def _load_heads(engine: EngineCore, heads: str | None, dtype: str, progress: Reporter,
                techniques: tuple[str, ...] = MODEL_PROPOSERS) -> None:
    """MTP / early-exit / draft-model proposers from a heads file (`find_heads`; none: n-gram only)."""
    loaded = _read_heads(heads, engine.cfg, dtype, progress)
    if loaded is not None:
        _add_heads(engine, *loaded, progress, techniques)


def _read_heads(heads: str | None, cfg: ModelConfig, dtype: str, progress: Reporter):
    """(DraftHeads, path, source) of the heads file `find_heads` picks, or None (noted) without one."""
    from engine.speculation.heads import DraftHeads

    path, source = find_heads(heads, cfg)
    if path is None:
        note(progress, f"engine: no draft heads for {cfg.name} (none given, none in "
                       f"{heads_cache_path(cfg.name).parent}, none shipped): n-gram speculation only")
        return None
    return DraftHeads.load(path, dtype=jnp.dtype(dtype)), path, source


def _add_heads(engine: EngineCore, loaded, path: Path, source: str, progress: Reporter,
               techniques: tuple[str, ...]) -> None:
    from engine.speculation.drafting import add_model_proposers

    add_model_proposers(engine, loaded, techniques)
    names = ", ".join(n for n in engine.proposers if n != "ngram")
    note(progress, f"engine: draft heads {path} ({source}, {loaded.nbytes() / 2**20:.1f} MiB): {names}")
