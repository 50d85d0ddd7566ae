"""Fuzz the files hloserve reads: GGUF model files and artifact manifests, many mutants, counted.

    python benchmarks/fuzz_files.py [--gguf 500] [--manifests 500] [--seed 1] [--limit 10]
                                    [--gguf-file PATH] [--artifact DIR] [--json PATH]

GGUF: --gguf mutants of the default model's file (SmolLM2-135M-Instruct Q4_1, fetched through
hloserve.exporter.presets; --gguf-file another), made by tests/support/gguf_mutants.py (the header,
key-values and tensor infos rewritten, every mutation kind in turn, details drawn from --seed), each
loaded in a worker process (tests/support/gguf_fuzz.py): load_gguf, the transformers config, the tokenizer and the HF model on the
meta device. Manifests: --manifests mutants of the manifest.json of --artifact (default the golden
tiny Llama, tests/golden/tiny_llama_v1), made by tests/support/manifest_mutants.py, each through
read_manifest, runtime.load and LLMArtifact.read.

A mutant passes when it ends within --limit seconds either refused with a one-line error (SourceError
for a GGUF, ArtifactError for a manifest) that names no Python exception, or loaded (and, for a GGUF,
built). Prints the counts by outcome and by mutation kind, every failing mutant, and exits 1 if any
failed. tests/exporter/test_gguf_fuzz.py and tests/runtime/test_manifest_fuzz.py run the first few
of seed 0 in the suite.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.support import gguf_fuzz, manifest_mutants  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXCEPTION_NAME = re.compile(r"\b[A-Z][A-Za-z]*(Error|Exception)\b|Traceback")


def failure(outcome: str, message: str, seconds: float, limit: float) -> str | None:
    """Why an outcome breaks the promise, or None."""
    if outcome not in ("refused", "loaded"):
        return outcome
    if seconds >= limit:
        return f"took {seconds:.1f} s"
    if outcome == "refused" and ("\n" in message or not message.strip() or EXCEPTION_NAME.search(message)):
        return "message not one clean line"
    return None


def fuzz_gguf(path: str, n: int, seed: int, limit: float) -> list[dict]:
    work = tempfile.mkdtemp(prefix="hloserve-fuzz-gguf-")
    start = time.monotonic()

    def progress(r: gguf_fuzz.Result) -> None:
        done = int(r.spec) + 1
        if done % 50 == 0 or failure(r.outcome, r.message, r.seconds, limit):
            print(f"[gguf {time.monotonic() - start:6.0f}s] {done}/{n}  {r.outcome}: {r.mutation[:60]}",
                  file=sys.stderr, flush=True)
    try:
        results = gguf_fuzz.run_mutants(path, seed, [str(i) for i in range(n)], work, limit=limit,
                                           on_result=progress)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return [dataclasses.asdict(r) for r in results]


def fuzz_manifests(artifact: str, n: int, seed: int) -> list[dict]:
    with open(os.path.join(artifact, "manifest.json")) as f:
        raw = json.load(f)
    work = tempfile.mkdtemp(prefix="hloserve-fuzz-manifest-")
    out = []
    try:
        for i in range(n):
            mutation, text = manifest_mutants.mutant_text(raw, seed, i)
            path = os.path.join(work, str(i))
            manifest_mutants.artifact_copy(artifact, path, text)
            t0 = time.perf_counter()
            outcome, message = manifest_mutants.try_artifact(path)
            out.append({"spec": str(i), "mutation": mutation, "outcome": outcome, "message": message,
                        "seconds": time.perf_counter() - t0})
            shutil.rmtree(path)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def report(name: str, results: list[dict], limit: float) -> int:
    """Print the counts and the failures; the number of failures."""
    by_outcome = collections.Counter(r["outcome"] for r in results)
    by_kind: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in results:
        by_kind[r["mutation"].split(":")[0]][r["outcome"]] += 1
    slowest = max((r["seconds"] for r in results), default=0.0)
    print(f"{name}: {len(results)} mutants: " + ", ".join(f"{k} {v}" for k, v in by_outcome.most_common())
          + f"; slowest {slowest:.2f} s")
    for kind, counts in sorted(by_kind.items()):
        print(f"  {kind:14s} " + ", ".join(f"{k} {v}" for k, v in counts.most_common()))
    failed = [(r, why) for r in results if (why := failure(r["outcome"], r["message"], r["seconds"], limit))]
    for r, why in failed:
        print(f"  FAILED {r['spec']} ({r['mutation']}): {why}: {r['message'][:300]}")
    return len(failed)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", type=int, default=500, help="GGUF mutants (0: none)")
    ap.add_argument("--manifests", type=int, default=500, help="manifest mutants (0: none)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--limit", type=float, default=10.0, help="seconds each mutant may take")
    ap.add_argument("--gguf-file", help="GGUF file to mutate (default: the default model's)")
    ap.add_argument("--artifact", default=os.path.join(REPO, "tests", "golden", "tiny_llama_v1"))
    ap.add_argument("--json", help="write every result here")
    args = ap.parse_args()
    started = time.monotonic()
    results: dict[str, list[dict]] = {}
    if args.gguf:
        from hloserve.exporter import presets
        path = args.gguf_file or presets.resolve("smollm2-135m-instruct")
        results["gguf"] = fuzz_gguf(path, args.gguf, args.seed, args.limit)
    if args.manifests:
        results["manifest"] = fuzz_manifests(args.artifact, args.manifests, args.seed)
    failed = sum(report(name, rs, args.limit) for name, rs in results.items())
    print(f"seed {args.seed}, {time.monotonic() - started:.0f} s, {failed} failed")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
