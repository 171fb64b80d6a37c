#!/usr/bin/env bash
# GPU check of the torch backend and trainer (and of the vLLM backend when vLLM is
# importable there): one command, no network, under 8 minutes.
#
#   bash bench/gpu_check.sh [OUT_JSON [gpu_check.py options]]
#
# OUT_JSON defaults to $OUT/gpu_check.json, else ./gpu_check.json; `--quick`
# (a tiny model, small workloads) checks the script itself on a CPU.
#
# Expects one NVIDIA GPU, Python 3.12 and a CUDA build of PyTorch already
# installed. Installs rlengine from this source tree without downloading
# anything: Python packages it lacks come from the wheel folder
# $RLENGINE_WHEELS (default: bench/wheels next to this script), then
# `pip install --no-deps --no-build-isolation --no-index .`. Then it runs
# bench/gpu_check.py from outside the tree (so the installed package is what
# runs), which builds a ~0.5B Qwen2 model locally and writes the figures.
# bench/gpu_check_multi.sh runs bench/gpu_check_multi.py the same way
# (RLENGINE_GPU_CHECK_SCRIPT, _NEEDS: more import:distribution pairs, _TIMEOUT).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/.." && pwd)"
out_json="${1:-${OUT:-$PWD}/gpu_check.json}"
shift || true
out_json="$(cd "$(dirname "$out_json")" && pwd)/$(basename "$out_json")"
wheels="${RLENGINE_WHEELS:-$here/wheels}"
py="${PYTHON:-python3}"

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 PIP_NO_INDEX=1
export PYTHONUNBUFFERED=1

echo "gpu_check: $("$py" --version) at $(command -v "$py")"
nvidia-smi -L || echo "gpu_check: nvidia-smi not found (no GPU: the figures will be CPU figures)"
"$py" -c "import torch; print('gpu_check: torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"

# Runtime and build requirements: import name -> distribution name.
missing=()
for pair in msgspec:msgspec numpy:numpy uvloop:uvloop safetensors:safetensors transformers:transformers \
            tokenizers:tokenizers jinja2:Jinja2 huggingface_hub:huggingface_hub setuptools:setuptools \
            wheel:wheel Cython:Cython ${RLENGINE_GPU_CHECK_NEEDS:-}; do
  if ! "$py" -c "import ${pair%%:*}" 2>/dev/null; then missing+=("${pair##*:}"); fi
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "gpu_check: installing from $wheels: ${missing[*]}"
  if [ ! -d "$wheels" ]; then
    echo "gpu_check: missing packages (${missing[*]}) and no wheel folder at $wheels (set RLENGINE_WHEELS)" >&2
    exit 2
  fi
  "$py" -m pip install --no-index --find-links "$wheels" "${missing[@]}"
fi

"$py" -m pip install --no-deps --no-build-isolation --no-index "$repo"

workdir="$(mktemp -d)"
trap 'rm -rf "$workdir"' EXIT
cd "$workdir"
"$py" -c "import rlengine, sys; assert not rlengine.__file__.startswith('$repo/rlengine'), rlengine.__file__; print('gpu_check: rlengine from', rlengine.__file__)"
timeout "${RLENGINE_GPU_CHECK_TIMEOUT:-420}" "$py" "$here/${RLENGINE_GPU_CHECK_SCRIPT:-gpu_check.py}" --out "$out_json" "$@"
echo "gpu_check: figures in $out_json"
