#!/bin/bash
# hloserve on one NVIDIA GPU in one go: versions and copy bandwidth; the 1B step in several variants (XLA
# options, the GPU layer_linear kernel on or off) against transformers eager and a static-cache
# torch.compile decoder; int8/int4 steps; the served model at c=1 and 16 in the fastest variant; the GPU
# tests; one summary JSON.
#
#   OUT=DIR bash benchmarks/gpu_check.sh       (from anywhere; OUT defaults to a new temporary directory)
#
# Made for a lent GPU machine without network whose python3 holds torch, jax with its CUDA plugin and
# transformers: wheels of the packages it lacks (fastapi, pydantic, llguidance, gguf, ...: docs/deploy.md,
# "Checking a GPU machine in one go") are taken from .whl/ at the repository root, installed into
# /tmp/site, and hloserve is put on the path from this checkout (no install); SmolLM2's tokenizer
# files (tokenizer.json, tokenizer_config.json, chat_template.jinja) come from $TOK (default .gpu/tok)
# so that the random-init model can be served. No step stops the next one; each has a time limit, and
# together they fit a 10-minute call. Everything printed also goes to $OUT/gpu_check.log.
#
#   $OUT/gpu_check.log             the whole output, with a summary at the end
#   $OUT/bandwidth.json            the device's copy bandwidth (bytes read + written over time)
#   $OUT/step_vs_transformers.json the step per call shape: hloserve in each variant (with kernels per
#                                  step, the device's busy share and the top kernels from a jax profile),
#                                  transformers eager, and transformers' static cache under torch.compile
#   $OUT/quant_steps.json          the same model exported with --quantize int8 and int4: its step per
#                                  call shape against the bf16 artifact's (quant_linear's Triton kernel)
#   $OUT/quant_inspect.txt         `hloserve inspect --platform cuda` of the int4 artifact (its kernels)
#   $OUT/served.json               benchmarks/serve.py's results (c=1, 16) under the fastest options
#   $OUT/tests.xml                 pytest's junit report of the GPU tests
#   $OUT/gpu-results.json          the summary (benchmarks/gpu_summary.py): goes to benchmarks/results/
#
# Knobs (environment): PYTHON (python3), STEP_S (270), QUANT_S (90), SERVE_S (120), TEST_S (50) seconds,
# TEST_WORKERS (4), SHAPE (llama-1b), VARIANTS (default,dsfusion,linear-kernel:
# step_vs_transformers.py's VARIANTS), STEP_SHAPES (1x1@300,16x16@300,64x64@300,256x1@0,256x1@1024), BENCH_ARGS (more
# step_vs_transformers.py flags, e.g. "--layers 2 --device cpu" to rehearse on a CPU), SERVE_PLATFORM
# (cuda), SERVE_ARGS, CONCURRENCY (1,16), REQUESTS (6,32), MAX_SEQS (16: c=64 needs 64 and more
# warm-up compiles), SIDES (hloserve,transformers,compiled), ANCHORS (an earlier run's
# step_vs_transformers.json whose anchors the summary takes where this run has none), WHEELS (.whl; a folder without wheels skips the install, as on a CPU rehearsal).
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HLOSERVE_CACHE=${HLOSERVE_CACHE:-/tmp/hloserve-gpu-check-cache}
export WORK=$HLOSERVE_CACHE/bench/gpu-check TOK=${TOK:-$PWD/.gpu/tok}
# exports run on the upper half of the cores while the lower half times the device
HALF=$(( $(nproc) / 2 )); LOW="taskset -c 0-$(( HALF > 1 ? HALF - 1 : 0 ))"; HIGH="taskset -c $HALF-$(( $(nproc) - 1 ))"
[ "$(nproc)" -ge 4 ] || { LOW=""; HIGH=""; }
# torch's threads match the half each process is pinned to (16 threads on 8 cores oversubscribe: the
# model build took 47.6 s there on 2026-11-30 against 20 s on this 2-core host)
[ -n "$LOW" ] && export OMP_NUM_THREADS=$HALF
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
  local site=${SITE:-/tmp/site} wheels=${WHEELS:-.whl}
  if ls "$wheels"/*.whl >/dev/null 2>&1; then
    echo "installing $(ls "$wheels"/*.whl | wc -l) wheels from $wheels/ into $site (no dependencies)"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$wheels"/*.whl \
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
import json, os, time
import jax.numpy as jnp
x = jnp.ones((1 << 29,), jnp.float32)                      # 2 GiB: a copy reads and writes 4 GiB
f = jax.jit(lambda a: a + 1, donate_argnums=0)             # donated: no allocation per call
for _ in range(3):
    x = f(x)
x.block_until_ready()
t0 = time.perf_counter()
for _ in range(20):
    x = f(x)
x.block_until_ready()
gb_s = 20 * 2 * x.nbytes / (time.perf_counter() - t0) / 1e9
print(f"device copy bandwidth (read + written): {gb_s:.0f} GB/s")
json.dump({"gb_s": gb_s, "device": str(jax.devices()[0].device_kind)}, open(os.environ["OUT"] + "/bandwidth.json", "w"))
EOF
}


gpu_tests() {
  # the `gpu`-marked tests only (the kernels compiled for the device against their decompositions, the
  # step on the device against the CPU); their files' interpret-mode tests are CPU work the suite does.
  # Each outcome prints as it ends (-v), so a step cut by its limit still says what passed and failed.
  local files
  files=$(grep -rl "mark.gpu" tests --include='test_*.py' | sort)
  echo "test files with gpu-marked tests: $files"
  XLA_PYTHON_CLIENT_PREALLOCATE=false "$PY" -m pytest $files -m gpu -p no:cacheprovider -v --tb=short -rfEs \
    --timeout 60 -n "${TEST_WORKERS:-4}" --junitxml "$OUT/tests.xml" -o junit_family=xunit1
}

steps() {
  # the model is built and exported once ($WORK/hf, $WORK/art, with SmolLM2's tokenizer: servable); the
  # int8/int4 exports start in the background on the upper cores as soon as the model is saved
  local exports="for q in int8 int4; do [ -d $WORK/art-\$q ] || $PY -m hloserve.server.cli export $WORK/hf -o $WORK/art-\$q --quantize \$q; done"
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 $LOW "$PY" benchmarks/step_vs_transformers.py --shape "${SHAPE:-llama-1b}" \
    --shapes "${STEP_SHAPES:-1x1@300,16x16@300,64x64@300,256x1@0,256x1@1024}" --repeats 20 \
    --sides "${SIDES:-hloserve,transformers,compiled}" --variants "${VARIANTS:-default,dsfusion,linear-kernel}" \
    --compiled-shapes 1x1@300,16x16@300 --side-timeout hloserve=170,transformers=50,compiled=90 --tokenizer-dir "$TOK" --work "$WORK" --json "$OUT/step_vs_transformers.json" \
    --after-build "$HIGH bash -c '$exports' > $WORK/quant_export.log 2>&1" ${BENCH_ARGS:-}
}

best_env() {   # the fastest variant of the steps, as `export NAME=VALUE` lines for eval
  "$PY" - <<'EOF'
import json, os, shlex, sys
sys.path.insert(0, "benchmarks")
from step_vs_transformers import VARIANTS
try:
    best = json.load(open(os.environ["OUT"] + "/step_vs_transformers.json"))["hloserve"]["best"]
except (OSError, KeyError, ValueError):
    best = "default"
print("; ".join(f"export {k}={shlex.quote(v)}" for k, v in VARIANTS[best].items()) or ":")
EOF
}

wait_for_exports() {   # the background int8/int4 exports (the calling step's limit bounds the wait)
  while pgrep -f "cli export $WORK/hf" >/dev/null; do sleep 1; done
}

quant() {
  # the bf16, int8 and int4 steps side by side (the ratio column: against bf16) under the fastest
  # options; `inspect --platform cuda` shows hloserve.quant_linear on its Triton kernel
  wait_for_exports
  [ -d "$WORK/art-int8" ] && [ -d "$WORK/art-int4" ] || { echo "the int8/int4 exports are missing:"; tail -5 "$WORK/quant_export.log"; return 1; }
  "$PY" -m hloserve.server.cli inspect "$WORK/art-int4" --platform cuda > "$OUT/quant_inspect.txt" || return 1
  grep -m1 "quant_linear" "$OUT/quant_inspect.txt"; grep "custom calls" "$OUT/quant_inspect.txt"
  eval "$(best_env)"
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 $LOW "$PY" benchmarks/step_shapes.py \
    "$WORK/art" "$WORK/art-int8" "$WORK/art-int4" --shapes 1x1@300,16x16@300,64x64@300,256x1@0 --repeats 9 \
    --json "$OUT/quant_steps.json"
}

served() {
  # the bf16 artifact served under the fastest options: c=1 and 16 (serve.py's streaming client)
  local env; env=$(best_env)
  echo "the fastest variant's environment: $env"; eval "$env"
  mkdir -p "$HLOSERVE_CACHE/bench"; ln -sfn "$WORK/hf" "$HLOSERVE_CACHE/bench/${SHAPE:-llama-1b}-hf"
  $LOW "$PY" benchmarks/serve.py --model "${SHAPE:-llama-1b}" --artifact "$WORK/art" \
    --tokenizer-dir "$TOK" --skip vllm,transformers,llama-server,llama-cpp-python --no-cold-start \
    --serve-args "--platform ${SERVE_PLATFORM:-cuda} --max-num-seqs ${MAX_SEQS:-16} ${SERVE_ARGS:-}" \
    --concurrency "${CONCURRENCY:-1,16}" --requests "${REQUESTS:-6,32}" --output-len 64 --long-requests 0
  cp "$(ls -t /tmp/hloserve-bench-*/results.json | head -1)" "$OUT/served.json"
}

summary() {
  "$PY" benchmarks/gpu_summary.py "$OUT" "$WORK/art" --commit "$(git rev-parse --short HEAD 2>/dev/null || echo '?')" \
    --gpu "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)" \
    --served "$OUT/served.json" ${ANCHORS:+--anchors "$ANCHORS"} -o "$OUT/gpu-results.json"
}

main() {
  echo "gpu_check: $(date -u +%FT%TZ) in $PWD, commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), OUT=$OUT"
  setup
  step versions 40 versions
  step steps "${STEP_S:-270}" steps
  step quant-steps "${QUANT_S:-90}" quant
  step served "${SERVE_S:-120}" served
  step summary 15 summary
  step gpu-tests "${TEST_S:-50}" gpu_tests
  echo; echo "=== summary ==="
  printf '%s\n' "${SUMMARY[@]}"
}

export -f versions gpu_tests steps best_env quant wait_for_exports served summary
export PY OUT LOW HIGH WORK TOK
main 2>&1 | tee "$OUT/gpu_check.log"
