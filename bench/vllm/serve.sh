#!/usr/bin/env bash
# Dev-only: vLLM's CPU build serving the folder convert.py wrote, under the
# model name crossover's OpenAI API reports. Ready in ~80-105 s on 2 cores.
#
#   bash bench/vllm/serve.sh [extra vLLM arguments...]
#
# Env: VLLM_VENV (default $HOME/.cache/crossover/vllm-venv), VLLM_MODEL
# (default $HOME/.cache/crossover/vllm-model), DTYPE (float32|bfloat16,
# default float32), PORT (default 8001), VLLM_CPU_KVCACHE_SPACE (GiB, default
# 2), VLLM_CPU_OMP_THREADS_BIND (default 0-1). Extra arguments go to vLLM,
# e.g. n-gram speculation:
#   bash bench/vllm/serve.sh --speculative-config \
#     '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
set -euo pipefail

VENV="${VLLM_VENV:-$HOME/.cache/crossover/vllm-venv}"
MODEL="${VLLM_MODEL:-$HOME/.cache/crossover/vllm-model}"
SERVED_NAME="gemma3-270m"  # engine/config.py ModelConfig.name: what crossover's /v1/models reports

die() { printf '[vllm-serve] %s\n' "$*" >&2; exit 1; }

[[ -x "$VENV/bin/python" ]] || die "no venv at $VENV: run bench/vllm/setup.sh"
[[ -f "$MODEL/config.json" ]] || die "no model folder at $MODEL: run bench/vllm/convert.py with $VENV/bin/python"
# awk reads every line: stopping at the first match would end ldconfig by SIGPIPE, which
# pipefail and set -e turn into a silent exit of this script.
TCMALLOC="$(ldconfig -p | awk '/libtcmalloc_minimal\.so\.4 /{lib = $NF} END {print lib}')"
[[ -n "$TCMALLOC" ]] || die "libtcmalloc_minimal.so.4 missing: apt-get install libtcmalloc-minimal4"
IOMP="$(find "$VENV" -name libiomp5.so -print -quit)"
[[ -n "$IOMP" ]] || die "libiomp5.so not found in $VENV: rerun bench/vllm/setup.sh"

export HF_HUB_OFFLINE=1
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}"
export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-0-1}"
export LD_PRELOAD="$TCMALLOC:$IOMP${LD_PRELOAD:+:$LD_PRELOAD}"

printf '[vllm-serve] %s as %s on port %s (%s)\n' "$MODEL" "$SERVED_NAME" "${PORT:-8001}" "${DTYPE:-float32}" >&2
exec "$VENV/bin/python" -m vllm.entrypoints.openai.api_server \
    --model "$MODEL" \
    --served-model-name "$SERVED_NAME" \
    --max-model-len 4096 \
    --dtype "${DTYPE:-float32}" \
    --port "${PORT:-8001}" \
    "$@"
