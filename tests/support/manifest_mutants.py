"""Mutants of an artifact's manifest.json, and what reading and loading each one does.

    text = mutant_text(raw, seed, i)       # mutant i of `seed` (deterministic): the manifest's JSON text
    outcome, message = try_artifact(dir)   # read_manifest, runtime.load, LLMArtifact.read on it

A mutation walks the manifest's JSON tree and changes one node: deletes a key, puts a value of
another type in its place (null, a string, a negative or huge number, a list, an object, a path out of
the artifact), moves a number (negative, zero, huge, off by one), changes a string, empties,
shortens, lengthens or reverses a list, adds or renames a key; or damages the text itself (cut
short, not an object). The kinds in KINDS are taken in turn, the details drawn from
random.Random(f"{seed}:{i}").

Outcomes: "refused" (an ArtifactError: its message kept), "loaded" (read, loaded and its LLM contract
read), "error" (any other exception).
"""
from __future__ import annotations

import copy
import json
import os
import random
from typing import Any, Callable

VALUES = (None, "x", "", -1, 0, 2**31, 2**63, -2**63, 10**30, 1.5, float("inf"), True, [], {}, ["x"], {"a": 1},
          "../../../etc/passwd", "/etc/passwd", "f99", "a" * 10000)


def _nodes(tree: Any, at: tuple = ()) -> list[tuple]:
    """Paths (tuples of keys and indices) to every node under the root."""
    out = []
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for k, v in items:
        out.append((*at, k))
        out += _nodes(v, (*at, k))
    return out


def _get(tree: Any, path: tuple) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def _pick(rng: random.Random, tree: Any, want: Callable[[Any], bool]) -> tuple | None:
    paths = [p for p in _nodes(tree) if want(_get(tree, p))]
    return rng.choice(paths) if paths else None


def _replace(tree: Any, path: tuple, value: Any) -> None:
    _get(tree, path[:-1])[path[-1]] = value


def k_delete(rng, tree):
    path = _pick(rng, tree, lambda v: True)
    parent = _get(tree, path[:-1])
    del parent[path[-1]]
    return f"deleted {'/'.join(map(str, path))}"


def k_retype(rng, tree):
    path = _pick(rng, tree, lambda v: True)
    value = rng.choice(VALUES)
    _replace(tree, path, value)
    return f"{'/'.join(map(str, path))} = {json.dumps(value)[:30]}"


def k_number(rng, tree):
    path = _pick(rng, tree, lambda v: isinstance(v, int) and not isinstance(v, bool))
    if path is None:
        return k_retype(rng, tree)
    old = _get(tree, path)
    _replace(tree, path, rng.choice([-1, 0, old + 1, old - 1, 2**31, 2**63, 10**30, -(10**30)]))
    return f"{'/'.join(map(str, path))}: {old} -> {_get(tree, path)}"


def k_string(rng, tree):
    path = _pick(rng, tree, lambda v: isinstance(v, str))
    old = _get(tree, path)
    _replace(tree, path, rng.choice(["", "../x", "/etc/passwd", "f99", "x" * 1000, "batch", "2*", "num_tokens",
                                     old + "x", old.upper()]))
    return f"{'/'.join(map(str, path))}: {old[:20]!r} -> {_get(tree, path)[:20]!r}"


def k_list(rng, tree):
    path = _pick(rng, tree, lambda v: isinstance(v, list) and v)
    if path is None:
        return k_retype(rng, tree)
    v = _get(tree, path)
    how = rng.choice(["empty", "drop last", "repeat last", "reverse"])
    _replace(tree, path, {"empty": [], "drop last": v[:-1], "repeat last": v + v[-1:], "reverse": v[::-1]}[how])
    return f"{'/'.join(map(str, path))}: {how}"


def k_key(rng, tree):
    path = () if rng.random() < 0.2 else _pick(rng, tree, lambda v: isinstance(v, dict))
    d = _get(tree, path) if path else tree
    if d and rng.random() < 0.6:
        old = rng.choice(list(d))
        new = rng.choice([old.upper(), old + "_", "", "../x"])
        d[new] = d.pop(old)
        return f"{'/'.join(map(str, path or ()))}: key {old!r} -> {new!r}"
    d["fuzz_" + str(rng.randrange(100))] = rng.choice(VALUES)
    return f"{'/'.join(map(str, path or ()))}: added a key"


KINDS: tuple[Callable, ...] = (k_retype, k_delete, k_number, k_string, k_list, k_key)


def mutant_text(raw: dict, seed: int, index: int) -> tuple[str, str]:
    """(what changed, manifest.json text) of mutant `index`; every 25th damages the text itself."""
    rng = random.Random(f"{seed}:{index}")
    if index % 25 == 24:
        text = json.dumps(raw)
        how = rng.choice(["cut", "array", "number", "nan"])
        return f"text: {how}", {"cut": text[:rng.randrange(len(text))], "array": "[1, 2]", "number": "7",
                                "nan": text.replace('"format_version": 1', '"format_version": NaN')}[how]
    tree = copy.deepcopy(raw)
    kind = KINDS[index % len(KINDS)]
    return f"{kind.__name__[2:]}: {kind(rng, tree)}", json.dumps(tree)


def artifact_copy(src: str, dst: str, manifest_text: str) -> None:
    """An artifact at `dst` whose files link to `src`'s, with its own manifest.json."""
    os.makedirs(dst)
    for name in os.listdir(src):
        if name != "manifest.json":
            os.symlink(os.path.join(os.path.abspath(src), name), os.path.join(dst, name))
    with open(os.path.join(dst, "manifest.json"), "w") as f:
        f.write(manifest_text)


def try_artifact(path: str) -> tuple[str, str]:
    """("refused", message) on an ArtifactError from read_manifest, runtime.load or LLMArtifact.read
    (the LLM contract checked against the functions, as a server reads it);
    ("loaded", "") when all three pass; ("error", "Type: message") on anything else."""
    from hloserve import runtime
    from hloserve.runtime.artifact import ArtifactError, LLMArtifact, read_manifest
    try:
        manifest = read_manifest(path)
        runtime.load(path, cache_dir=None, manifest=manifest)
        if manifest.is_llm:
            LLMArtifact.read(path, manifest)
    except ArtifactError as e:
        return "refused", str(e)
    except Exception as e:  # noqa: BLE001 - what the fuzzer looks for
        return "error", f"{type(e).__name__}: {e}"
    return "loaded", ""
