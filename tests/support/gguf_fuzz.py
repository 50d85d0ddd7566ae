"""GGUF mutants (tests/support/gguf_mutants.py) loaded in a worker process, each under a deadline.

    results = run_mutants(path, seed, ["0", "1", "named:block_count"], workdir, limit=10.0)

The worker (`python -m tests.support.gguf_fuzz SRC SEED WORKDIR SPEC...`) loads the unmutated file once
(so the lazy imports happen before any clock), then writes each mutant and loads it: load_gguf,
hf_config into a transformers config, the tokenizer.json into a `tokenizers` Tokenizer that encodes a
line, and the HF model built on the meta device with every tensor's shape compared to the model's.
Outcomes: "refused" (a SourceError: its message kept), "loaded", "error" (any other exception, or a
loaded file whose build check failed), "hang" (no answer within `limit` seconds of the load's start:
the worker is killed, a new one goes on with the next mutant) and "crash" (the worker died).
"""
from __future__ import annotations

import dataclasses
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterable

from . import gguf_mutants

REPO = gguf_mutants.REPO


@dataclasses.dataclass(frozen=True)
class Result:
    spec: str
    mutation: str
    outcome: str        # refused | loaded | error | hang | crash
    message: str
    seconds: float


def check_built(ckpt: Any) -> None:
    """A loaded checkpoint builds: a transformers config, a tokenizer that encodes, and the HF model
    (on the meta device) whose every parameter is one of the file's tensors, of the same shape."""
    import tokenizers
    import torch
    import transformers

    from hloserve.exporter.gguf.checkpoint import hf_config
    raw = hf_config(ckpt)
    raw.pop("rope_freq_factors", None)
    config = transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)
    tokenizers.Tokenizer.from_str(ckpt.tokenizer_json).encode("Hello, world! 2024 <|im_start|>")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    for name, t in ckpt.tensors.items():
        if shapes.get(name) != t.shape:
            raise AssertionError(f"{name}: file {t.shape}, model {shapes.get(name)}")
    missing = set(shapes) - set(ckpt.tensors) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    if missing:
        raise AssertionError(f"the model has parameters the file lacks: {sorted(missing)[:4]}")


def _emit(event: dict) -> None:
    print("@@" + json.dumps(event), flush=True)


def _worker(src: str, seed: int, workdir: str, specs: list[str]) -> None:
    """Write and load each mutant; one "loading" line before the load, one "done" line after."""
    import tokenizers  # noqa: F401 - imported before the clock starts
    import torch  # noqa: F401
    import transformers  # noqa: F401

    from hloserve.exporter.errors import SourceError
    from hloserve.exporter.gguf.checkpoint import load_gguf
    base = gguf_mutants.Base.parse(src)
    check_built(load_gguf(src))    # the unmutated file loads (and the lazy imports happen before any clock)
    path = os.path.join(workdir, "model.gguf")
    for spec in specs:
        name, lay = gguf_mutants.make(base, seed, spec)
        lay.write(path)
        _emit({"spec": spec, "mutation": name, "event": "loading"})
        start = time.perf_counter()
        try:
            ckpt = load_gguf(path)
        except SourceError as e:
            outcome, message = "refused", str(e)
        except Exception as e:  # noqa: BLE001 - what the fuzzer looks for
            outcome, message = "error", f"{type(e).__name__}: {e}"
        else:
            try:
                check_built(ckpt)
                outcome, message = "loaded", ""
            except Exception as e:  # noqa: BLE001
                outcome, message = "error", f"loaded, but does not build: {type(e).__name__}: {e}"
        _emit({"spec": spec, "mutation": name, "event": "done", "outcome": outcome, "message": message,
               "seconds": time.perf_counter() - start})


def _lines(stream, q: queue.Queue) -> None:
    for line in stream:
        if line.startswith("@@"):
            q.put(json.loads(line[2:]))
    q.put(None)


def run_mutants(src: str, seed: int, specs: Iterable[str], workdir: str, *, limit: float = 10.0,
                start_timeout: float = 300.0, on_result: Callable[[Result], None] | None = None) -> list[Result]:
    """Load each mutant in a worker process; a mutant with no answer `limit` seconds after its load
    began is a "hang" (the worker is killed, a new one goes on with the next), a worker that dies is a
    "crash". The worker's stderr goes to WORKDIR/worker.log."""
    pending, results = list(specs), []
    while pending:
        with open(os.path.join(workdir, "worker.log"), "a") as log:
            proc = subprocess.Popen([sys.executable, "-m", "tests.support.gguf_fuzz", src, str(seed), workdir,
                                     *pending], cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True,
                                    start_new_session=True)
        q: queue.Queue = queue.Queue()
        threading.Thread(target=_lines, args=(proc.stdout, q), daemon=True).start()
        loading = None
        while True:
            try:
                event = q.get(timeout=limit if loading else start_timeout)
            except queue.Empty:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                if loading is None:
                    raise RuntimeError(f"the mutant worker wrote nothing for {start_timeout} s; see {workdir}/worker.log")
                event = {**loading, "event": "done", "outcome": "hang", "message": f"no answer within {limit} s",
                         "seconds": limit}
            if event is None:
                code = proc.wait()
                if loading is None:
                    if pending and code:
                        raise RuntimeError(f"the mutant worker failed (exit {code}); see {workdir}/worker.log")
                    break
                event = {**loading, "event": "done", "outcome": "crash", "message": f"the worker died (exit {code})",
                         "seconds": 0.0}
            if event.get("event") == "loading":
                loading = event
                continue
            result = Result(event["spec"], event["mutation"], event["outcome"], event["message"], event["seconds"])
            results.append(result)
            if on_result is not None:
                on_result(result)
            pending.remove(result.spec)
            loading = None
            if result.outcome in ("hang", "crash"):
                break
        proc.wait()
    return results


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:])
