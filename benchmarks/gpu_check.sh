#!/bin/bash
# hloserve on one NVIDIA GPU in one go: versions, the GPU tests, the LLM step against transformers eager.
#
#   OUT=DIR bash benchmarks/gpu_check.sh       (from anywhere; OUT defaults to a new temporary directory)
#
# Made for a lent GPU machine without network whose python3 holds torch, jax with its CUDA plugin and
# transformers: wheels of the packages it lacks (fastapi, pydantic, llguidance, gguf, ...: docs/deploy.md,
# "Checking a GPU machine in one go") are taken from .whl/ at the repository root, installed into
# /tmp/site, and hloserve is put on the path from this checkout (no install). No step stops the next one; each has
# a time limit. Everything printed also goes to $OUT/gpu_check.log.
#
#   $OUT/gpu_check.log             the whole output, with a summary at the end
#   $OUT/tests.xml                 pytest's junit report of the GPU tests
#   $OUT/step_vs_transformers.json the step's latency per call shape, hloserve and transformers eager
#   $OUT/quant_steps.txt           the same model exported with --quantize int8 and int4: its step per call
#                                  shape against the bf16 artifact's (hloserve.quant_linear's Triton kernel)
#   $OUT/quant_inspect.txt         `hloserve inspect --platform cuda` of the int4 artifact (its kernels)
#
# Knobs (environment): PYTHON (python3), TEST_S (120), BENCH_S (210) and QUANT_S (300) seconds, TEST_WORKERS (4),
# SHAPE (llama-1b: a serve.py shape), STEP_SHAPES (1x1@300,16x16@300,64x64@300,256x1@0,256x1@1024),
# (the chunk shapes, 256x1@0 and 256x1@1024, have more rows than sequences: the Triton kernel's tile
# path runs them; the decode shapes take its per-token path: docs/deploy.md, "Kernels per platform"),
# BENCH_ARGS (more step_vs_transformers.py flags, e.g. "--layers 2 --device cpu" to rehearse on a CPU).
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HLOSERVE_CACHE=${HLOSERVE_CACHE:-/tmp/hloserve-gpu-check-cache}
declare -a SUMMARY

step() {   # step NAME LIMIT_S FUNCTION: run FUNCTION under a time limit, note its status and duration
  local name=$1 limit=$2 t0=$SECONDS rc
  echo; echo "=== $name (limit ${limit} s) ==="
  timeout -k 10 "$limit" bash -c "$3"
  rc=$?
  [ $rc = 124 ] || [ $rc = 137 ] && echo "=== $name: TIMED OUT after ${limit} s"
  SUMMARY+=("$name: exit $rc in $((SECONDS - t0)) s")
}

setup() {
  local site=${SITE:-/tmp/site}
  if ls .whl/*.whl >/dev/null 2>&1; then
    echo "installing $(ls .whl/*.whl | wc -l) wheels from .whl/ into $site (no dependencies)"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
      || echo "WARNING: the wheels did not install; imports of the server's packages may fail"
    export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
  fi
  # hloserve.exporter -> exporter/, ... as pyproject's package-dir maps them (a namespace package)
  mkdir -p /tmp/hloserve-src/hloserve
  for p in exporter runtime server quantization; do ln -sfn "$PWD/$p" "/tmp/hloserve-src/hloserve/$p"; done
  export PYTHONPATH=/tmp/hloserve-src${PYTHONPATH:+:$PYTHONPATH}:$PWD
}

versions() {
  nvidia-smi || echo "(no nvidia-smi)"
  echo "host: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
  XLA_PYTHON_CLIENT_PREALLOCATE=false "$PY" - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0], sys.executable)
for name in ("jax", "jaxlib", "torch", "transformers", "numpy", "fastapi", "pydantic", "llguidance", "gguf"):
    try:
        m = importlib.import_module(name)
        print(f"{name} {getattr(m, '__version__', '?')} from {m.__file__}")
    except Exception as e:
        print(f"{name}: NOT importable ({type(e).__name__}: {e})")
import jax
print("jax.devices():", jax.devices(), "default backend:", jax.default_backend())
try:
    import torch
    print("torch.cuda.is_available():", torch.cuda.is_available(),
          torch.cuda.get_device_name() if torch.cuda.is_available() else "")
except ImportError as e:
    print("torch:", e)
import hloserve.runtime, hloserve.server.cli  # noqa: F401
print("hloserve.runtime and the server import from", hloserve.runtime.__file__)
import hloserve.exporter.export  # noqa: F401  (needs torch)
print("hloserve.exporter imports")
EOF
}

gpu_tests() {
  # the files holding `gpu`-marked tests; their tests that need the SmolLM2 GGUF (a PyPI download) are
  # left out: this machine has no network; so are the quant kernels' interpret-mode and inspect checks
  # (CPU work the suite does; the device's own runs of those kernels stay)
  local files
  files=$(grep -rl "mark.gpu" tests --include='test_*.py' | sort)
  echo "test files with gpu-marked tests: $files"
  XLA_PYTHON_CLIENT_PREALLOCATE=false "$PY" -m pytest $files -p no:cacheprovider -q -rfEs --timeout 120 \
    -n "${TEST_WORKERS:-4}" --junitxml "$OUT/tests.xml" -o junit_family=xunit1 \
    --deselect tests/server/test_accelerators.py::test_llm_step_is_lowered_for_every_platform_by_default \
    --deselect tests/server/test_accelerators.py::test_accelerator_path_in_interpret_mode_matches_the_cpu \
    --deselect tests/server/test_accelerators.py::test_inspect_names_each_platforms_kernels \
    --deselect tests/runtime/test_pallas_quant.py::test_kernel_matches_the_decomposition \
    --deselect tests/server/test_accelerators.py::test_inspect_names_the_quantized_linears_kernels
}

bench() {
  # each side in its own process with the device to itself; jax takes 60% of it up front
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 "$PY" benchmarks/step_vs_transformers.py --shape "${SHAPE:-llama-1b}" \
    --shapes "${STEP_SHAPES:-1x1@300,16x16@300,64x64@300,256x1@0,256x1@1024}" --repeats 20 \
    --work /tmp/hloserve-gpu-check-bench --json "$OUT/step_vs_transformers.json" ${BENCH_ARGS:-}
}

quant() {
  # bench's model (its work directory) exported with --quantize int8 and int4; the plan shows that
  # hloserve.quant_linear runs the Triton kernel (runtime/kernels/pallas/quant_gpu.py), then the steps
  # of the bf16, int8 and int4 artifacts side by side (the ratio column: against bf16)
  local work=/tmp/hloserve-gpu-check-bench q
  [ -d "$work/hf" ] && [ -d "$work/art" ] || { echo "no model or bf16 artifact in $work (bench did not export)"; return 1; }
  for q in int8 int4; do
    [ -d "$work/art-$q" ] || "$PY" -m hloserve.server.cli export "$work/hf" -o "$work/art-$q" --quantize "$q" || return 1
  done
  "$PY" -m hloserve.server.cli inspect "$work/art-int4" --platform cuda > "$OUT/quant_inspect.txt" || return 1
  grep -m1 "quant_linear" "$OUT/quant_inspect.txt"; grep "custom calls" "$OUT/quant_inspect.txt"
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 "$PY" benchmarks/step_shapes.py "$work/art" "$work/art-int8" "$work/art-int4" \
    --shapes "${STEP_SHAPES:-1x1@300,16x16@300,64x64@300,256x1@0,256x1@1024}" --repeats 9 | tee "$OUT/quant_steps.txt"
}

main() {
  echo "gpu_check: $(date -u +%FT%TZ) in $PWD, commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), OUT=$OUT"
  setup
  step versions 60 versions
  step gpu-tests "${TEST_S:-120}" gpu_tests
  step step-vs-transformers "${BENCH_S:-210}" bench
  step quant-steps "${QUANT_S:-300}" quant
  echo; echo "=== summary ==="
  printf '%s\n' "${SUMMARY[@]}"
}

export -f versions gpu_tests bench quant
export PY OUT
main 2>&1 | tee "$OUT/gpu_check.log"
