"""Bucket policy: power-of-two defaults, explicit lists, padding and slicing (pure numpy, no compile)."""
from __future__ import annotations

import numpy as np
import pytest

from hloserve.runtime.artifact import SymbolSpec
from hloserve.runtime.buckets import BucketError, Buckets, pad_to, powers_of_two, slice_to

SYMBOLS = {"batch": SymbolSpec("batch", 1, 64), "seq": SymbolSpec("seq", 3, 10), "n": SymbolSpec("n", 1, None)}


@pytest.mark.parametrize("lo,hi,want", [
    (1, 64, (1, 2, 4, 8, 16, 32, 64)),
    (3, 10, (3, 4, 8, 10)),
    (5, 5, (5,)),
    (1, 1, (1,)),
    (2, 3, (2, 3)),
])
def test_powers_of_two(lo, hi, want):
    assert powers_of_two(lo, hi) == want


def test_default_buckets_only_for_paddable_dims():
    b = Buckets.build(SYMBOLS, ["batch"])
    assert b.sizes == {"batch": (1, 2, 4, 8, 16, 32, 64)}
    assert [b.bucket("batch", v) for v in (1, 3, 5, 33, 64)] == [1, 4, 8, 64, 64]
    assert b.bucket("seq", 7) == 7                     # not paddable: exact size
    assert b.plan({"batch": 5, "seq": 7}) == {"batch": 8, "seq": 7}


def test_explicit_buckets_and_overflow():
    b = Buckets.build(SYMBOLS, ["batch"], {"batch": [16, 1, 8, 8]})
    assert b.sizes["batch"] == (1, 8, 16)
    assert b.bucket("batch", 9) == 16
    assert b.bucket("batch", 17) is None               # above the last bucket: compiled exactly
    assert b.plan({"batch": 17}) == {"batch": 17}


def test_unbounded_dim_gets_capped_powers_of_two():
    b = Buckets.build(SYMBOLS, ["n"])
    assert b.sizes["n"][:3] == (1, 2, 4) and b.sizes["n"][-1] == 1 << 16


@pytest.mark.parametrize("explicit,match", [
    ({"seq": [4, 8]}, "does not declare it paddable"),
    ({"batch": [0, 8]}, r"outside its range \[1, 64\]"),
    ({"batch": [65]}, "outside its range"),
    ({"nope": [1]}, "not a dim of the artifact"),
    ({"batch": []}, "empty"),
])
def test_bad_bucket_lists(explicit, match):
    with pytest.raises(BucketError, match=match):
        Buckets.build(SYMBOLS, ["batch"], explicit)


def test_pad_and_slice_round_trip():
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    p = pad_to("x", x, (4, 2))
    assert p.shape == (4, 2) and (p[3] == 0).all() and (p[:3] == x).all()
    assert pad_to("x", x, (3, 2)) is x                   # nothing to pad: no copy
    assert (slice_to(p, (3, 2)) == x).all()
    with pytest.raises(ValueError, match="larger than its bucket"):
        pad_to("x", x, (2, 2))
