#!/bin/bash
# What benchmarks/gpu_check.sh needs beside the checkout on a lent GPU machine without network, made here:
#
#   bash benchmarks/gpu_prepare.sh        (PYTHON: the venv whose package versions the wheels match)
#
#   .whl/      wheels (Python 3.12, manylinux x86-64, no dependencies) of the server's packages that the
#              machine's image lacks, at the versions installed here
#   .gpu/tok/  SmolLM2's tokenizer files and config.json (the 1B shape borrows its vocabulary), from the
#              HF copy benchmarks/serve.py makes of the SmolLM2 GGUF (made here if missing)
#
# Both folders are ignored by git (.git/info/exclude) and travel with the device call as `carry`:
#   run(command="OUT=$OUT bash benchmarks/gpu_check.sh > /dev/null 2>&1; tail -c 6000 $OUT/gpu_check.log",
#       carry=[".whl", ".gpu"], timeout_s=600)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
for d in /.whl/ /.gpu/; do grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude; done
mkdir -p .whl .gpu/tok

# the packages the machine's image does not hold (docs/deploy.md), at this venv's versions
names="fastapi starlette uvicorn pydantic pydantic_core annotated-types annotated-doc typing-inspection opentelemetry-api llguidance gguf"
for name in $names; do
  version=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
  ls .whl | grep -qi "^${name//-/_}-${version}-" && continue
  echo "wheel: $name==$version"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl "$name==$version"
done

# SmolLM2's tokenizer and config (vocabulary 49,152) for the random-init 1B shape that gpu_check serves
"$PY" - <<'EOF'
import os, shutil, sys
sys.path.insert(0, "benchmarks")
from serve import PRESET, hf_model_dir
from hloserve.exporter import presets
from hloserve.runtime.paths import cache_dir
hf = hf_model_dir(presets.resolve(PRESET), os.path.join(cache_dir(), "bench", "smollm2-hf"))
for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"):
    if os.path.exists(os.path.join(hf, name)):
        shutil.copy(os.path.join(hf, name), os.path.join(".gpu", "tok", name))
print("tokenizer files:", sorted(os.listdir(os.path.join(".gpu", "tok"))))
EOF
du -sh .whl .gpu
