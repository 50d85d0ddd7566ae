"""Soak: a real `hloserve serve` under a steady mixed load for a long time; nothing may leak or drift.

    python benchmarks/soak.py [--artifact DIR] [--minutes 30] [--concurrency 16] [--seed 0]
                              [--report-every 60] [--server-args "--num-blocks 512"] [--cache DIR]
                              [--downloads DIR] [--json PATH]

Starts the server (on --artifact, else the default model: `hloserve serve` with no artifact, which
exports SmolLM2-135M-Instruct into the cache root on first use) with a fresh cache root
(HLOSERVE_CACHE in a temporary directory; --cache uses a given one; --downloads copies the `pypi/`
downloads of another cache root in first, so a fresh root does not download the preset again). Then,
for --minutes, --concurrency clients each send one request after another, drawn from this mix
(seeded; see MIX):

  * plain completions, streamed and not, and chat completions: prompts from a few words to a few
    hundred tokens (a fixed pool, so prompts repeat and the prefix cache is hit), max_tokens 4..256
    (capped to the context), greedy;
  * structured output: chat with `response_format: {"type": "json_schema", ...}` (SCHEMA), greedy;
    the answer must parse and validate with jsonschema;
  * n=2 completions (temperature 0.8, seeded): two choices;
  * 20% leavers: half streams closed after 1..4 chunks, half non-streaming requests whose client
    closes the socket right after sending (the server must abort them and free their blocks).

Every --report-every seconds one progress line goes to stderr: elapsed time, requests done, leavers
and errors, the server's RSS, KV blocks in use, compiles after warm-up, p50/p99 end-to-end latency of
the interval's completed requests. At the end the clients stop, the script waits until the server is
idle and prints a summary: requests (sent = completed + left + errors), errors (any non-200, transport
error, error event, wrong finish reason, invalid JSON: every one is unexpected), RSS drift (first
interval after warm-up against the last, MiB and %), the KV blocks back to free (used 0, free ==
total), compiles after warm-up, engine requests accounted for (the server's finished counts by reason,
aborts included, add up to the engine requests sent: n per request), preemptions and prefix-cache
hits, p99 per interval. Exit status 1 when there were errors, leaked blocks, compiles after warm-up or
unaccounted requests; RSS drift and latencies are reported, not judged. --json PATH writes the summary.

tests/server/test_soak.py runs it for 1.5 minutes on a tiny model with a small KV cache (preemption).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.support.launch import free_port, http  # noqa: E402  (the repository's root, for tests.support)

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches under bright "
         "autumn skies near old stone bridges and busy harbour markets where merchants sell copper kettles").split()
PROMPT_WORDS = (2, 5, 12, 30, 60, 120, 200, 320)     # words per pool prompt: a few words to a few hundred tokens
MAX_TOKENS = (4, 16, 32, 64, 128, 256)
SCHEMA = {"type": "object",
          "properties": {"color": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer", "enum": [1, 2, 3]},
                         "ok": {"type": "boolean"}},
          "required": ["color", "count", "ok"], "additionalProperties": False}
# request kind -> share of the mix (20% leavers)
MIX = {"stream": 0.25, "plain": 0.15, "chat": 0.10, "structured": 0.15, "n2": 0.15,
       "leave_stream": 0.10, "leave_sent": 0.10}
LEAVERS = ("leave_stream", "leave_sent")
FINISHED_OK = ("stop", "length")


# -- the server ------------------------------------------------------------------------------------
def serve_command(artifact: str | None, port: int, server_args: list[str]) -> list[str]:
    """`hloserve serve [ARTIFACT] --port PORT ...` as this interpreter runs it."""
    return [sys.executable, "-m", "hloserve.server.cli", "serve", *([artifact] if artifact else []),
            "--port", str(port), *server_args]


def log_tail(path: str, n: int = 3000) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-n:]


def wait_ready(proc: subprocess.Popen, base: str, log_path: str, timeout: float) -> float:
    """Seconds until GET base/ready answered 200; raises when the server exits or the timeout passes."""
    t0 = time.monotonic()
    last = t0
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready ({log_path}):\n"
                               f"{log_tail(log_path)}")
        with contextlib.suppress(httpx.HTTPError):
            if http().get(f"{base}/ready", timeout=2).status_code == 200:
                return time.monotonic() - t0
        now = time.monotonic()
        if now - t0 > timeout:
            raise RuntimeError(f"the server is not ready after {timeout:.0f} s ({log_path}):\n{log_tail(log_path)}")
        if now - last > 30:
            progress(f"  ... {now - t0:.0f} s, not ready yet")
            last = now
        time.sleep(0.25)


@contextlib.contextmanager
def running(artifact: str | None, server_args: list[str], cache: str, log_path: str, timeout: float):
    """A server in a session of its own on the cache root `cache`; yields (base URL, process,
    seconds to ready); on exit SIGTERM, then SIGKILL of its process group."""
    port = free_port()
    cmd = serve_command(artifact, port, server_args)
    progress(f"$ HLOSERVE_CACHE={cache} {shlex.join(cmd)}  (log {log_path})")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "HLOSERVE_CACHE": cache})
    try:
        base = f"http://127.0.0.1:{port}"
        secs = wait_ready(proc, base, log_path, timeout)
        progress(f"ready after {secs:.1f} s")
        yield base, proc, secs
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def copy_downloads(src_root: str, cache: str) -> None:
    """Copy the cache root `src_root`'s pypi/ (preset downloads, checked again on use) into `cache`."""
    src = os.path.join(os.path.expanduser(src_root), "pypi")
    if os.path.isdir(src) and not os.path.exists(os.path.join(cache, "pypi")):
        shutil.copytree(src, os.path.join(cache, "pypi"))


def rss_mib(pid: int) -> float:
    """Resident memory of process `pid` (MiB), from /proc/PID/status (psutil elsewhere)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import psutil
    return psutil.Process(pid).memory_info().rss / 2**20


# -- /metrics --------------------------------------------------------------------------------------
def parse_metrics(text: str) -> dict[str, float]:
    """The samples the soak watches: {name: value}, plus `finished:<reason>` per finish reason."""
    out: dict[str, float] = {}
    for name in ("hloserve:kv_cache_used_blocks", "hloserve:kv_cache_free_blocks", "hloserve:kv_cache_total_blocks",
                 "hloserve:compiles_after_warmup_total", "hloserve:requests_in_flight", "vllm:num_requests_running",
                 "vllm:num_requests_waiting", "vllm:num_preemptions_total", "vllm:prefix_cache_hits_total"):
        m = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M)
        if m is None:
            raise RuntimeError(f"metric {name} missing from /metrics")
        out[name] = float(m.group(1))
    for reason, value in re.findall(r'^vllm:request_success_total{[^}]*finished_reason="([^"]+)"[^}]*} (\S+)$',
                                    text, re.M):
        out[f"finished:{reason}"] = float(value)
    return out


def finished_by_reason(m: dict[str, float]) -> dict[str, float]:
    return {k.split(":", 1)[1]: v for k, v in m.items() if k.startswith("finished:")}


def is_idle(m: dict[str, float]) -> bool:
    return (m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
            and m["hloserve:requests_in_flight"] == 0)


async def wait_idle(client: httpx.AsyncClient, timeout: float) -> dict[str, float]:
    """The metrics once nothing runs, waits or is admitted (aborts are waited for); a hang detector,
    not a speed bound: raises after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        m = parse_metrics((await client.get("/metrics", timeout=30)).text)
        if is_idle(m):
            return m
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server is not idle {timeout:.0f} s after the load stopped: {m}")
        await asyncio.sleep(0.25)


# -- the request mix -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PoolPrompt:
    text: str
    tokens: int          # as a completion prompt
    chat_tokens: int     # as the one user message of a chat (template included)


@dataclasses.dataclass(frozen=True)
class Planned:
    """One request of the mix: its kind, body and what the client does with it."""
    kind: str
    path: str
    body: dict
    leave_after: int = 0          # leave_stream: chunks read before closing

    @property
    def engine_requests(self) -> int:
        return int(self.body.get("n", 1))


def make_prompt_texts(seed: int, n: int = 48) -> list[str]:
    """n prompts from a few words to a few hundred (PROMPT_WORDS), seeded."""
    rng = random.Random(seed)
    return [f"Note {i}: " + " ".join(rng.choice(WORDS) for _ in range(PROMPT_WORDS[i % len(PROMPT_WORDS)]))
            for i in range(n)]


async def measure_pool(client: httpx.AsyncClient, texts: list[str], model: str, max_model_len: int,
                       min_room: int = 32) -> list[PoolPrompt]:
    """The prompts with their token counts (the server's /tokenize, plain and as a chat); those that
    leave fewer than `min_room` tokens of context are dropped."""
    pool = []
    for text in texts:
        plain = (await client.post("/tokenize", json={"model": model, "prompt": text})).json()["count"]
        chat = (await client.post("/tokenize", json={"model": model, "messages": [
            {"role": "user", "content": text}]})).json()["count"]
        if max_model_len - max(plain, chat) >= min_room:
            pool.append(PoolPrompt(text, plain, chat))
    if not pool:
        raise RuntimeError(f"no prompt fits a context of {max_model_len} tokens")
    return pool


def plan_request(rng: random.Random, pool: list[PoolPrompt], model: str, max_model_len: int,
                 mix: dict[str, float] = MIX) -> Planned:
    """Draw one request of the mix (kind by its share, a pool prompt, max_tokens that fit the context)."""
    kind = rng.choices(list(mix), weights=list(mix.values()))[0]
    p = rng.choice(pool)
    room = max_model_len - max(p.tokens, p.chat_tokens)
    max_tokens = min(rng.choice(MAX_TOKENS), room)
    greedy = {"temperature": 0}
    if kind in ("stream", "plain"):
        return Planned(kind, "/v1/completions", {"model": model, "prompt": p.text, "max_tokens": max_tokens,
                                                 "stream": kind == "stream", **greedy})
    if kind == "chat":
        return Planned(kind, "/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": p.text}], "max_tokens": max_tokens,
            "stream": rng.random() < 0.5, **greedy})
    if kind == "structured":
        return Planned(kind, "/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": f"Describe a thing as JSON. {p.text[:200]}"}],
            "max_tokens": min(96, room - 16), "stream": rng.random() < 0.5,
            "response_format": {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA,
                                                                       "strict": True}}, **greedy})
    if kind == "n2":
        return Planned(kind, "/v1/completions", {"model": model, "prompt": p.text, "max_tokens": max_tokens, "n": 2,
                                                 "temperature": 0.8, "seed": rng.randrange(1 << 30)})
    if kind == "leave_stream":       # long enough that it cannot finish before the client has left
        return Planned(kind, "/v1/completions", {"model": model, "prompt": p.text, "max_tokens": min(room, 256),
                                                 "stream": True, "ignore_eos": True, **greedy},
                       leave_after=rng.randint(1, 4))
    if kind == "leave_sent":         # the whole rest of the context: the server sees the disconnect long before
        return Planned(kind, "/v1/completions", {"model": model, "prompt": p.text, "max_tokens": room,
                                                 "ignore_eos": True, **greedy})
    raise ValueError(f"unknown request kind {kind!r}")


# -- one request ----------------------------------------------------------------------------------
@dataclasses.dataclass
class Outcome:
    kind: str
    ok: bool                      # completed and valid (a leaver: left as planned)
    error: str | None
    seconds: float
    end: float                    # time.monotonic() when it ended
    engine_requests: int


class RequestError(Exception):
    """The server's answer to a request that should have succeeded was wrong (status, body, stream)."""


def check_choice(planned: Planned, text: str, reason: str | None) -> None:
    """One choice's finish reason is stop/length; a structured answer parses and validates."""
    if reason not in FINISHED_OK:
        raise RequestError(f"finish_reason {reason!r}")
    if planned.kind == "structured":
        if reason != "stop":
            raise RequestError(f"structured output cut off ({reason}): {text[:200]!r}")
        import jsonschema
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
        except (ValueError, jsonschema.ValidationError) as e:
            raise RequestError(f"structured output invalid ({type(e).__name__}): {text[:200]!r}") from None


async def _streamed(client: httpx.AsyncClient, planned: Planned, timeout: float) -> None:
    chat = planned.path.endswith("chat/completions")
    texts: dict[int, list[str]] = {}
    reasons: dict[int, str | None] = {}
    chunks, done = 0, False
    async with client.stream("POST", planned.path, json=planned.body, timeout=timeout) as r:
        if r.status_code != 200:
            raise RequestError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                break
            body = json.loads(data)
            if "error" in body:
                raise RequestError(f"error event: {body['error']}")
            for c in body.get("choices") or []:
                i = c.get("index", 0)
                piece = (c.get("delta") or {}).get("content") if chat else c.get("text")
                texts.setdefault(i, []).append(piece or "")
                reasons[i] = c.get("finish_reason") or reasons.get(i)
            chunks += 1
            if planned.leave_after and chunks >= planned.leave_after:
                return                      # leaves: the unread body closes the connection
    if planned.leave_after:
        return                              # ended before the client left: fine too (the server decided)
    if not done:
        raise RequestError("the stream ended without [DONE]")
    if not texts:
        raise RequestError("the stream had no choices")
    for i in sorted(texts):
        check_choice(planned, "".join(texts[i]), reasons.get(i))


async def _answered(client: httpx.AsyncClient, planned: Planned, timeout: float) -> None:
    r = await client.post(planned.path, json=planned.body, timeout=timeout)
    if r.status_code != 200:
        raise RequestError(f"HTTP {r.status_code}: {r.text[:300]!r}")
    choices = r.json()["choices"]
    if len(choices) != planned.engine_requests:
        raise RequestError(f"{len(choices)} choices for n={planned.engine_requests}")
    chat = planned.path.endswith("chat/completions")
    for c in choices:
        check_choice(planned, c["message"]["content"] if chat else c["text"], c["finish_reason"])


async def _send_and_leave(base: str, planned: Planned) -> None:
    """Send the request and close the socket at once: no timer decides when the client leaves."""
    url = httpx.URL(base)
    body = json.dumps(planned.body).encode()
    reader, writer = await asyncio.open_connection(url.host, url.port)
    writer.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (planned.path.encode(), url.host.encode(), len(body), body))
    await writer.drain()
    writer.close()
    await writer.wait_closed()


async def run_request(client: httpx.AsyncClient, base: str, planned: Planned, timeout: float) -> Outcome:
    """Send `planned` and check the answer; every failure becomes an Outcome with its error."""
    t0 = time.monotonic()
    error = None
    try:
        if planned.kind == "leave_sent":
            await _send_and_leave(base, planned)
        elif planned.body.get("stream"):
            await _streamed(client, planned, timeout)
        else:
            await _answered(client, planned, timeout)
    except RequestError as e:
        error = f"{planned.kind}: {e}"
    except (httpx.HTTPError, OSError, ValueError, KeyError) as e:   # transport errors, bad JSON
        error = f"{planned.kind}: {type(e).__name__}: {e}"
    end = time.monotonic()
    return Outcome(planned.kind, error is None, error, end - t0, end, planned.engine_requests)


async def client_loop(client: httpx.AsyncClient, base: str, rng: random.Random, pool: list[PoolPrompt], model: str,
                      max_model_len: int, deadline: float, outcomes: list[Outcome], timeout: float) -> None:
    """One client: requests of the mix back to back until `deadline` (the last one started finishes)."""
    while time.monotonic() < deadline:
        outcomes.append(await run_request(client, base, plan_request(rng, pool, model, max_model_len), timeout))


# -- report ----------------------------------------------------------------------------------------
def progress(msg: str) -> None:
    print(f"[soak] {msg}", file=sys.stderr, flush=True)


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def interval_record(t_start: float, t_from: float, t_to: float, outcomes: list[Outcome], m: dict[str, float],
                    rss: float) -> dict:
    """One report interval: counts so far, the server's state now, latencies of the interval's completions."""
    lat = [o.seconds for o in outcomes if o.ok and o.kind not in LEAVERS and t_from <= o.end < t_to]
    return {"elapsed_s": round(t_to - t_start, 1), "done": sum(o.ok and o.kind not in LEAVERS for o in outcomes),
            "left": sum(o.ok and o.kind in LEAVERS for o in outcomes), "errors": sum(not o.ok for o in outcomes),
            "rss_mib": round(rss, 1), "used_blocks": m["hloserve:kv_cache_used_blocks"],
            "running": m["vllm:num_requests_running"], "waiting": m["vllm:num_requests_waiting"],
            "compiles_after_warmup": m["hloserve:compiles_after_warmup_total"], "completed": len(lat),
            "p50_ms": round(percentile(lat, 50) * 1000, 1), "p99_ms": round(percentile(lat, 99) * 1000, 1)}


def interval_line(r: dict) -> str:
    return (f"{r['elapsed_s']:7.0f} s: {r['done']} done, {r['left']} left, {r['errors']} errors | RSS "
            f"{r['rss_mib']:.0f} MiB | blocks used {r['used_blocks']:.0f} | running {r['running']:.0f} waiting "
            f"{r['waiting']:.0f} | compiles after warm-up {r['compiles_after_warmup']:.0f} | interval: "
            f"{r['completed']} completed, p50 {r['p50_ms']:.0f} ms, p99 {r['p99_ms']:.0f} ms")


def summarize(outcomes: list[Outcome], intervals: list[dict], start: dict[str, float], final: dict[str, float],
              final_rss: float) -> dict:
    """The run's summary, with `failures`: what makes the exit status 1."""
    by_kind: dict[str, dict] = {}
    for o in outcomes:
        k = by_kind.setdefault(o.kind, {"sent": 0, "ok": 0, "errors": 0})
        k["sent"] += 1
        k["ok" if o.ok else "errors"] += 1
    errors = [o.error for o in outcomes if not o.ok]
    left = sum(o.ok and o.kind in LEAVERS for o in outcomes)
    done = sum(o.ok and o.kind not in LEAVERS for o in outcomes)
    before, after = finished_by_reason(start), finished_by_reason(final)
    finished = {r: after.get(r, 0) - before.get(r, 0) for r in sorted(set(before) | set(after))}
    finished = {r: int(n) for r, n in finished.items() if n}
    engine_sent = sum(o.engine_requests for o in outcomes)
    rss = [r["rss_mib"] for r in intervals]
    first, last = (rss[0], rss[-1]) if rss else (final_rss, final_rss)
    s = {
        "requests": len(outcomes), "completed": done, "left": left, "errors": len(errors),
        "error_samples": errors[:20], "by_kind": by_kind,
        "engine_requests_sent": engine_sent, "engine_finished": finished,
        "engine_finished_total": sum(finished.values()),
        "accounted": len(outcomes) == done + left + len(errors) and sum(finished.values()) == engine_sent,
        "rss_first_mib": first, "rss_last_mib": last, "rss_final_idle_mib": round(final_rss, 1),
        "rss_drift_mib": round(last - first, 1), "rss_drift_pct": round(100 * (last - first) / first, 2) if first else 0,
        "used_blocks": final["hloserve:kv_cache_used_blocks"], "free_blocks": final["hloserve:kv_cache_free_blocks"],
        "total_blocks": final["hloserve:kv_cache_total_blocks"],
        "compiles_after_warmup": final["hloserve:compiles_after_warmup_total"],
        "preemptions": final["vllm:num_preemptions_total"] - start["vllm:num_preemptions_total"],
        "prefix_cache_hit_tokens": final["vllm:prefix_cache_hits_total"] - start["vllm:prefix_cache_hits_total"],
        "p99_ms_per_interval": [r["p99_ms"] for r in intervals],
        "intervals": intervals,
    }
    s["blocks_leaked"] = s["used_blocks"] != 0 or s["free_blocks"] != s["total_blocks"]
    s["failures"] = check_summary(s)
    return s


def check_summary(s: dict) -> list[str]:
    """What is wrong with a run (empty when it passed): errors, leaked blocks, compiles after warm-up,
    requests not accounted for."""
    out = []
    if s["errors"]:
        out.append(f"{s['errors']} request errors, e.g. {s['error_samples'][0]}")
    if s["blocks_leaked"]:
        out.append(f"KV blocks leaked: used {s['used_blocks']:.0f}, free {s['free_blocks']:.0f} of "
                   f"{s['total_blocks']:.0f} when idle")
    if s["compiles_after_warmup"]:
        out.append(f"{s['compiles_after_warmup']:.0f} compiles after warm-up")
    if not s["accounted"]:
        out.append(f"requests not accounted for: {s['requests']} sent, {s['completed']} completed + {s['left']} "
                   f"left + {s['errors']} errors; engine: {s['engine_requests_sent']} sent, "
                   f"{s['engine_finished_total']} finished {s['engine_finished']}")
    return out


def summary_lines(s: dict) -> list[str]:
    kinds = ", ".join(f"{k} {v['sent']}" for k, v in sorted(s["by_kind"].items()))
    return [
        f"requests: {s['requests']} ({kinds}): {s['completed']} completed, {s['left']} left as planned, "
        f"{s['errors']} errors",
        f"engine: {s['engine_requests_sent']} requests sent, finished {s['engine_finished']} "
        f"({'all accounted for' if s['accounted'] else 'NOT accounted for'}); preemptions {s['preemptions']:.0f}, "
        f"prefix-cache hits {s['prefix_cache_hit_tokens']:.0f} tokens",
        f"RSS: {s['rss_first_mib']:.0f} MiB in the first interval, {s['rss_last_mib']:.0f} MiB in the last "
        f"(drift {s['rss_drift_mib']:+.1f} MiB, {s['rss_drift_pct']:+.2f}%), {s['rss_final_idle_mib']:.0f} MiB idle",
        f"KV blocks when idle: used {s['used_blocks']:.0f}, free {s['free_blocks']:.0f} of {s['total_blocks']:.0f}"
        f" ({'leaked' if s['blocks_leaked'] else 'all free'})",
        f"compiles after warm-up: {s['compiles_after_warmup']:.0f}",
        "p99 latency per interval (ms): " + " ".join(f"{x:.0f}" for x in s["p99_ms_per_interval"]),
    ]


# -- the run ---------------------------------------------------------------------------------------
async def soak(base: str, pid: int, *, seconds: float, concurrency: int, seed: int, report_every: float,
               request_timeout: float, idle_timeout: float) -> dict:
    """Run the mix against the server at `base` (process `pid`) for `seconds`; returns the summary."""
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=request_timeout) as client, \
            httpx.AsyncClient(base_url=base, timeout=30) as probe:
        card = (await probe.get("/v1/models")).json()["data"][0]
        model, max_model_len = card["id"], int(card["max_model_len"])
        pool = await measure_pool(probe, make_prompt_texts(seed), model, max_model_len)
        progress(f"model {model}, context {max_model_len}; {len(pool)} prompts of "
                 f"{min(p.tokens for p in pool)}..{max(p.tokens for p in pool)} tokens; {concurrency} clients for "
                 f"{seconds / 60:.1f} min")
        start = await wait_idle(probe, idle_timeout)
        outcomes: list[Outcome] = []
        intervals: list[dict] = []
        t0 = time.monotonic()
        deadline = t0 + seconds
        loops = [asyncio.create_task(client_loop(client, base, random.Random(seed * 1000 + i), pool, model,
                                                 max_model_len, deadline, outcomes, request_timeout))
                 for i in range(concurrency)]
        t_prev = t0

        async def report(now: float) -> None:
            m = parse_metrics((await probe.get("/metrics")).text)
            intervals.append(interval_record(t0, t_prev, now, outcomes, m, rss_mib(pid)))
            progress(interval_line(intervals[-1]))

        while pending := [t for t in loops if not t.done()]:
            await asyncio.wait(pending, timeout=max(0.0, t_prev + report_every - time.monotonic()))
            now = time.monotonic()
            if now >= t_prev + report_every:
                await report(now)
                t_prev = now
        if time.monotonic() - t_prev >= report_every / 2 or not intervals:   # the last, shorter interval
            await report(time.monotonic())
        for t in loops:
            t.result()      # a bug in the client itself surfaces here
        progress(f"load stopped after {time.monotonic() - t0:.0f} s; waiting until the server is idle")
        final = await wait_idle(probe, idle_timeout)
        return summarize(outcomes, intervals, start, final, rss_mib(pid))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", help="artifact directory (default: the default model, `hloserve serve` with none)")
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--report-every", type=float, default=60.0, help="seconds between progress lines")
    ap.add_argument("--server-args", default="", help="more `hloserve serve` flags, one shell-quoted string")
    ap.add_argument("--cache", help="cache root (HLOSERVE_CACHE) to use (default: a fresh temporary one)")
    ap.add_argument("--downloads", help="a cache root whose pypi/ downloads are copied into the fresh one")
    ap.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take (hangs)")
    ap.add_argument("--ready-timeout", type=float, default=1800.0)
    ap.add_argument("--idle-timeout", type=float, default=300.0, help="seconds to become idle after the load")
    ap.add_argument("--json", help="write the summary here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = tempfile.mkdtemp(prefix="hloserve-soak-")
    cache = args.cache or os.path.join(work, "cache")
    os.makedirs(cache, exist_ok=True)
    if args.downloads:
        copy_downloads(args.downloads, cache)
    server_args = shlex.split(args.server_args)
    with running(args.artifact, server_args, cache, os.path.join(work, "server.log"), args.ready_timeout) as (
            base, proc, ready_s):
        summary = asyncio.run(soak(base, proc.pid, seconds=args.minutes * 60, concurrency=args.concurrency,
                                   seed=args.seed, report_every=args.report_every,
                                   request_timeout=args.request_timeout, idle_timeout=args.idle_timeout))
        if proc.poll() is not None:
            summary["failures"].append(f"the server exited with {proc.returncode} during the soak")
    summary.update({"argv": sys.argv[1:], "artifact": args.artifact or "default model", "minutes": args.minutes,
                    "concurrency": args.concurrency, "seed": args.seed, "server_args": server_args,
                    "ready_s": round(ready_s, 1), "log": os.path.join(work, "server.log")})
    print("\nsoak summary" + f" ({args.minutes:g} min, {args.concurrency} clients, {summary['artifact']}):")
    for line in summary_lines(summary):
        print(f"  {line}")
    print("result: " + ("PASS" if not summary["failures"] else "FAIL: " + "; ".join(summary["failures"])))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    if not args.cache:
        shutil.rmtree(cache, ignore_errors=True)
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
