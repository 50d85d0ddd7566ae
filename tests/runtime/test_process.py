"""Runtime behaviour across processes: persistent compile cache, no torch, SPMD on 4 host devices."""
from __future__ import annotations

import json
import os
import shutil

from tests.runtime.conftest import run_python

FIRST_RESULT = """
import json, sys
import numpy as np
from hloserve import runtime
from hloserve.runtime.client import compile_events
model = runtime.load({art!r}, cache_dir={cache!r})
fn = model.functions["forward"]
y = np.asarray(fn(x=np.ones((3, 64), np.float32))["y"])
ev = compile_events()
print(json.dumps({{"hits": fn.stats.persistent_cache_hits, "compiles": fn.stats.compiles,
                  "jax_hits": ev.cache_hits, "jax_misses": ev.cache_misses, "y": float(y.sum()),
                  "torch": "torch" in sys.modules}}))
"""


def _first_result(art, cache):
    return json.loads(run_python(FIRST_RESULT.format(art=art, cache=cache)).strip().splitlines()[-1])


def test_second_process_hits_the_persistent_cache(mlp_artifact, tmp_path):
    cache = str(tmp_path / "cache")
    cold = _first_result(mlp_artifact, cache)
    assert cold["compiles"] == 1 and cold["hits"] == 0 and cold["jax_misses"] == 1
    assert os.listdir(os.path.join(cache, "executables"))
    warm = _first_result(mlp_artifact, cache)
    # the executable cache answers without lowering: jax is not even asked
    assert warm["compiles"] == 1 and warm["hits"] == 1 and warm["jax_hits"] == warm["jax_misses"] == 0
    assert warm["y"] == cold["y"]
    # without our executable cache, jax's persistent cache (keyed on the lowered module) still hits
    shutil.rmtree(os.path.join(cache, "executables"))
    fallback = _first_result(mlp_artifact, cache)
    assert fallback["hits"] == 1 and fallback["jax_hits"] == 1 and fallback["jax_misses"] == 0
    assert fallback["y"] == cold["y"]


def test_corrupted_cache_entry_recompiles(mlp_artifact, tmp_path):
    cache = str(tmp_path / "cache")
    cold = _first_result(mlp_artifact, cache)
    edir = os.path.join(cache, "executables")
    for name in os.listdir(edir):
        with open(os.path.join(edir, name), "wb") as f:
            f.write(b"not an executable")
    again = _first_result(mlp_artifact, cache)
    assert again["y"] == cold["y"] and again["compiles"] == 1


def test_an_entry_that_would_run_code_when_unpickled_is_never_unpickled(mlp_artifact, tmp_path):
    """The cache holds data: a pickle planted under the key looked up (unpickling it would create
    a marker file), an entry whose payload was swapped, and one copied from another key are all
    misses that fall through to jax, with the same result."""
    import pickle

    cache = str(tmp_path / "cache")
    marker = tmp_path / "pwned"
    cold = _first_result(mlp_artifact, cache)
    edir = os.path.join(cache, "executables")
    (name,) = os.listdir(edir)
    entry = os.path.join(edir, name)

    class Plant:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    good = open(entry, "rb").read()
    header, _, payload = good.partition(b"\n")
    other = json.loads(header)
    other["key"] = "0" * 64
    for planted in (pickle.dumps(Plant()),                                  # code, the old format's loader ran it
                    header + b"\n" + payload[:-7] + b"garbage",           # payload overwritten
                    json.dumps(other).encode() + b"\n" + payload):       # an entry of another key
        with open(entry, "wb") as f:
            f.write(planted)
        again = _first_result(mlp_artifact, cache)
        # our entry missed (jax was asked, and its own cache answered) and nothing ran
        assert again["y"] == cold["y"] and again["compiles"] == 1 and again["jax_hits"] == 1
        assert not marker.exists()


UNWRITABLE = """
import json, logging, sys
import numpy as np
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
from hloserve import runtime
model = runtime.load({art!r})   # the default cache root: $HLOSERVE_CACHE
y = np.asarray(model.functions["forward"](x=np.ones((3, 64), np.float32))["y"])
print(json.dumps({{"y": float(y.sum()), "cache": model.client.cache_dir}}))
"""


def test_a_cache_root_that_cannot_be_created_serves_without_a_cache(mlp_artifact, tmp_path):
    """A read-only or full cache volume, or a path through a file: the model loads and runs, with one
    warning saying every start compiles, instead of failing to start."""
    (tmp_path / "file").write_text("x")
    out = run_python(UNWRITABLE.format(art=mlp_artifact), env={"HLOSERVE_CACHE": str(tmp_path / "file" / "cache")})
    result = json.loads(out.strip().splitlines()[-1])
    assert result["cache"] is None and "running without it" in out, out
    assert result["y"] == _first_result(mlp_artifact, str(tmp_path / "cache"))["y"]


BROKEN_ENTRY = """
import json
import numpy as np
from hloserve import runtime
from hloserve.runtime import exec_cache

class Broken:   # deserializes but fails to run, like an XLA:CPU entry missing its kernels
    def __call__(self, *args):
        raise RuntimeError("Function wrapped_iota not found")

get = exec_cache.ExecutableCache.get
exec_cache.ExecutableCache.get = lambda self, key, devices: Broken() if get(self, key, devices) else None
model = runtime.load({art!r}, cache_dir={cache!r})
fn = model.functions["forward"]
y = np.asarray(fn(x=np.ones((3, 64), np.float32))["y"])
y2 = np.asarray(fn(x=np.ones((3, 64), np.float32))["y"])
print(json.dumps({{"compiles": fn.stats.compiles, "y": float(y.sum()), "y2": float(y2.sum())}}))
"""


def test_cache_entry_that_fails_to_run_is_rebuilt_once(mlp_artifact, tmp_path):
    cache = str(tmp_path / "cache")
    cold = _first_result(mlp_artifact, cache)
    out = json.loads(run_python(BROKEN_ENTRY.format(art=mlp_artifact, cache=cache)).strip().splitlines()[-1])
    # the same shape rebuilt in place of the broken entry: one executable counted, same result
    assert out["compiles"] == 1 and out["y"] == out["y2"] == cold["y"]
    again = _first_result(mlp_artifact, cache)   # the rebuilt executable was written back
    assert again["hits"] == 1 and again["y"] == cold["y"]


def test_runtime_never_imports_torch(mlp_artifact, tmp_path):
    out = _first_result(mlp_artifact, str(tmp_path / "cache"))
    assert out["torch"] is False


SPMD = """
import json
import numpy as np
import jax
from hloserve import runtime
assert len(jax.devices()) == 4, jax.devices()
rules = [(r"layers\\.\\d+\\.up\\.weight$", ("model", None)),    # column split
         (r"layers\\.\\d+\\.up\\.bias$", ("model",)),
         (r"layers\\.\\d+\\.down\\.weight$", (None, "model")),  # row split
         (r".*", ())]
x = np.random.default_rng(0).standard_normal((5, 64), dtype=np.float32)
single = runtime.load({art!r}, devices=[0], cache_dir=None)
sharded = runtime.load({art!r}, mesh={{"model": 4}}, partition_rules=rules, cache_dir=None)
want = np.asarray(single.functions["forward"](x=x)["y"])
got = np.asarray(sharded.functions["forward"](x=x)["y"])
per_device = {{}}
total_split = 0
for name, w in sharded.weights.items():
    if name.endswith(("up.weight", "up.bias", "down.weight")):
        total_split += w.nbytes
        for shard in w.addressable_shards:
            per_device[shard.device.id] = per_device.get(shard.device.id, 0) + shard.data.nbytes
hlo = next(iter(sharded.functions["forward"]._executables.values())).as_text()
# the sharded executable round-trips through the on-disk executable cache onto the same devices
outs = []
for _ in range(2):
    m = runtime.load({art!r}, mesh={{"model": 4}}, partition_rules=rules, cache_dir={cache!r})
    outs.append(np.asarray(m.functions["forward"](x=x)["y"]))
cache_hits = m.functions["forward"].stats.persistent_cache_hits
from_ours = m.functions["forward"].from_executable_cache({{}}) or any(
    m.functions["forward"].from_executable_cache(e) for e in m.functions["forward"].compiled_shapes)
print(json.dumps({{"err": float(np.abs(got - want).max()), "per_device": per_device, "total_split": total_split,
                  "all_reduce": hlo.count("all-reduce("), "all_gather": hlo.count("all-gather("),
                  "cached_err": float(max(np.abs(o - want).max() for o in outs)), "cache_hits": cache_hits, "from_ours": from_ours, "spec": list(sharded.weights["layers.0.up.weight"].sharding.spec)}}))
"""


def test_spmd_megatron_rules_match_single_device(mlp_artifact, tmp_path):
    out = run_python(SPMD.format(art=mlp_artifact, cache=str(tmp_path / "cache")), env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4"})
    r = json.loads(out.strip().splitlines()[-1])
    assert r["err"] < 1e-5, r
    assert r["spec"] == ["model", None]
    assert sorted(r["per_device"]) == ["0", "1", "2", "3"]
    for nbytes in r["per_device"].values():
        assert nbytes == r["total_split"] // 4           # each device holds a quarter of the split weights
    # XLA inserted exactly the row-split reductions, one per layer, and gathered nothing
    assert r["all_reduce"] == 2 and r["all_gather"] == 0
    assert r["cache_hits"] == 1 and r["cached_err"] < 1e-5
    assert r["from_ours"], "the sharded executable should come back from hloserve's executable cache"


def test_partition_rules_errors(mlp_artifact):
    code = f"""
from hloserve import runtime
from hloserve.runtime.sharding import ShardingError
cases = [dict(mesh={{"model": 3}}, partition_rules=[(r"up\\.weight$", ("model", None))]),
         dict(mesh={{"model": 8}}),
         dict(mesh={{"model": 4}}, partition_rules=[(r"up\\.weight$", ("data", None))]),
         dict(mesh={{"model": 4}}, partition_rules=[(r"up\\.bias$", ("model", None))]),
         dict(partition_rules=[(r".*", ())])]
for kw in cases:
    try:
        runtime.load({mlp_artifact!r}, cache_dir=None, **kw)
    except ShardingError as e:
        print(str(e))
    else:
        print("no error")
"""
    out = run_python(code, env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}).strip().splitlines()
    assert "not divisible by 3" in out[0] and "layers.0.up.weight" in out[0]
    assert "needs 8 devices, but 4 are available" in out[1]
    assert "names mesh axis 'data'" in out[2]
    assert "(rank 2) for weight 'layers.0.up.bias'" in out[3]
    assert "partition_rules need a mesh" in out[4]
