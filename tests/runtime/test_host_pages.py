"""Weights on a CPU host in 2 MiB pages (runtime/host_pages.py): the copy holds the file's values,
jax aliases it (no second copy), and where the kernel has transparent huge pages, huge pages back it."""
from __future__ import annotations

import re

import jax
import numpy as np
import pytest
import torch

from hloserve.runtime import host_pages


def _thp_mode() -> str | None:
    """The kernel's transparent-huge-page mode (always, madvise, never), None where it has none."""
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return None
    found = re.search(r"\[(\w+)\]", text)
    return found.group(1) if found else None


def _huge_bytes_at(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            inside = int(m.group(1), 16) <= address < int(m.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def test_the_copy_holds_the_values_read_only_on_a_huge_page_boundary():
    view = np.arange(3 * 1024 * 1024, dtype=np.int16).reshape(3, 1024, 1024)[:, ::-1]   # not contiguous
    copy = host_pages.copy_in_huge_pages(view)
    np.testing.assert_array_equal(copy, view)
    assert copy.dtype == view.dtype and copy.flags.c_contiguous and not copy.flags.writeable
    assert copy.ctypes.data % host_pages.HUGE_PAGE == 0
    with pytest.raises(ValueError):
        copy[0, 0, 0] = 1


def test_a_loaded_models_large_weights_are_aliased_copies_in_huge_pages(tmp_path):
    """A Linear of 1024 x 1024 f32 (4 MiB) loaded on the CPU: its device array is the 2 MiB-aligned
    copy itself (jax aliased it: one copy of the weights, not two), the outputs are torch's; and with
    the kernel's THP on, huge pages back the copy."""
    from hloserve.exporter.export import EntryPoint, export_artifact
    from hloserve.runtime import load

    torch.manual_seed(0)
    module = torch.nn.Linear(1024, 1024).eval()
    x = torch.randn(4, 1024)
    export_artifact(str(tmp_path / "art"), [EntryPoint("forward", module, (x,), input_names=["x"],
                                                       output_names=["y"])], source="test")
    model = load(str(tmp_path / "art"), cache_dir=str(tmp_path / "cache"))
    big = [a for a in model.weights.values() if a.nbytes >= host_pages.MIN_BYTES]
    small = [a for a in model.weights.values() if a.nbytes < host_pages.MIN_BYTES]
    assert len(big) == 1 and len(small) == 1
    address = big[0].unsafe_buffer_pointer()
    assert address % host_pages.HUGE_PAGE == 0
    with torch.no_grad():
        want = module(x).numpy()
    got = np.asarray(model.functions["forward"](x=x.numpy())["y"])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    if _thp_mode() in ("always", "madvise"):
        assert _huge_bytes_at(address) >= host_pages.HUGE_PAGE, "the weight's copy is in 4 KiB pages"


def test_jax_aliases_a_huge_page_copy_on_the_cpu():
    """What the load relies on: device_put of the aligned copy keeps its buffer (no second copy)."""
    copy = host_pages.copy_in_huge_pages(np.ones((1024, 1024), np.float32))
    placed = jax.device_put(copy, jax.devices("cpu")[0])
    assert placed.unsafe_buffer_pointer() == copy.ctypes.data
