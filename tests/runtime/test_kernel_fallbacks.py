"""The CPU kernels as CPUs without AMX, without AVX-512 or without AVX2 run them: the library built
here with another -march, then tests/runtime/test_kernels.py's instruction-picking cases (and the other kernel
test files') run against it in a child pytest. A file of its own so that `--dist loadfile` runs these
builds on another worker than test_kernels.py's own build and rebuild."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hloserve.runtime.kernels.cpu import build

KERNEL_TESTS = os.path.join(os.path.dirname(__file__), "test_kernels.py")

# the instruction sets a CPU of this kind may lack, each built for the features that select it
FALLBACKS = {"x86-64-v2": "sse4_2",          # no AVX2: the portable loops
             "x86-64-v3": "avx2",            # AVX2 only: the widened products
             "cooperlake": "avx512_bf16"}    # AVX512-BF16 without AMX: vdpbf16ps tiles

# what the fallback builds run: every path that picks instructions (the linears' row tiles and
# 64-byte chunks at K=576, quantized layouts of both versions; attention's multi-row chunk with every
# cache dtype, window and soft-cap, and the short path of one head shape with every cache dtype), not
# the shapes that only vary the same code
FALLBACK_SELECTION = ("(layer_linear_kernel_matches and 64-70) or (quant_linear_kernel_matches and 576-) or "
                      "(quant_linear_v4_kernel_matches and 576-) or (quant_linear_v6_kernel and 576-) or "
                      "grouped_experts_kernel_matches or (quant_experts_kernel_matches and 6-2) or "
                      "kquant_kernel_matches or kquant_kernel_reads_only or "
                      "(paged_attention_kernel_matches and (chunk37 or (short and 3-64))) or "
                      "rounds_both_products or row_sum_kernel or past_its_row_limit or layer_linear_tiles or grouped_experts_tiles or "
                      "both_ends_of_their_range")
# the other kernels' test files the fallback builds run (one build for all of them)
FALLBACK_FILES = ("test_experts_kernel.py", "test_kquant_kernels.py", "test_batch_invariance.py")
# what GFNI changes: quant_linear.cc's widen_int4 (int4 bytes to int8, one affine transform a half)
GFNI_SELECTION = "(quant_linear_kernel_matches and 576- and int4) or (quant_linear_v6_kernel and 576- and int4)"


def selection(march: str, flags: list[str]) -> str | None:
    """The tests the -march=MARCH build runs on a CPU with these flags; None where this CPU's own build
    (the suite's native kernels) takes the same paths, so that build is not made again."""
    if march == "x86-64-v3" and "avx512f" not in flags:
        return None                    # without AVX-512 the native build is the AVX2 one
    if march == "cooperlake" and "amx_tile" not in flags:
        # the native build is AVX512-BF16 (and VNNI) without AMX as well (Zen 4, Zen 5): the two
        # differ where the native one has GFNI, and only there
        return GFNI_SELECTION if "gfni" in flags else None
    return FALLBACK_SELECTION


@pytest.mark.slow
@pytest.mark.parametrize("march", sorted(FALLBACKS))
def test_fallback_builds_pass_the_kernel_tests(march, tmp_path):
    """The kernels as a CPU without AMX (or without AVX-512, or without AVX2) runs them, built here
    with -march=MARCH, pass the same comparisons against the decompositions and torch (x86-64-v3:
    AVX2's integer steps, no AVX-512 VNNI; x86-64-v2: the portable loops, B tiles included)."""
    if not build.enabled() or not build.find_compiler():
        pytest.skip("the CPU kernels are off or no C++ compiler is here (the portable path is tested elsewhere)")
    flags = open("/proc/cpuinfo").read().split()
    if FALLBACKS[march] not in flags:
        pytest.skip(f"this CPU cannot run a -march={march} build")
    chosen = selection(march, flags)
    if chosen is None:
        pytest.skip(f"this CPU's own build takes the -march={march} paths (the native kernel tests ran them)")
    # the child's conftest points HLOSERVE_CACHE at HLOSERVE_TEST_CACHE (else a fresh directory)
    # TESTED_SHAPES_ENV: the decode attention specialized for test_kernels.py's head shapes alone (the
    # same code for them; a quarter of the attention files' compile)
    # JAX_COMPILATION_CACHE_DIR: the children keep the XLA executables of the comparisons (the
    # decompositions, the kernels' call wrappers: the same HLO whichever library the process loaded;
    # a custom call binds to the loaded handler by name) in one place for the run, so the second build
    # compiles almost nothing again (its tests 124 -> 51 s, 2026-12-02)
    env = {**os.environ, "HLOSERVE_TEST_CACHE": str(tmp_path), "HLOSERVE_KERNEL_CACHE": str(tmp_path / "kernels"),
           build.MARCH_ENV: march, build.TESTED_SHAPES_ENV: "1",
           "JAX_COMPILATION_CACHE_DIR": os.path.join(os.environ["HLOSERVE_TEST_CACHE"], "jax-kernel-tests"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}
    others = [os.path.join(os.path.dirname(__file__), name) for name in FALLBACK_FILES]
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", KERNEL_TESTS, *others, "-k", chosen],
                         env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:]
    assert " passed" in out.stdout and " skipped" not in out.stdout, out.stdout[-500:]
    assert list(tmp_path.rglob("libhloserve_cpu.so")), "the kernels were not built for this -march"
