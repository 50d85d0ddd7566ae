"""`hloserve serve [ARTIFACT | MODEL.gguf | PRESET]`: build the service, start uvicorn, warm up in the background.

/health answers at once; /ready answers 503 until warm-up has compiled every
bucket (then the engine loop starts). With no ARTIFACT, the default model
(SmolLM2-135M-Instruct) is exported into the cache on first use — in a
subprocess, so the serving process itself never imports torch — with
DEFAULT_EXPORT_FLAGS: bf16 weight matrices and KV cache under f32 activations, the
form XLA:CPU serves fastest at many concurrent requests (docs/performance.md). A GGUF file
or a preset named on the command line is exported the same way, once, in the format
`--quantize` picks (`auto`: the file's own blocks, `gguf`; docs/quantization.md "Which format
to pick on a CPU").
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

from hloserve.runtime.artifact import LLMArtifact
from hloserve.runtime.artifact.errors import HloserveError
from hloserve.runtime.artifact.llm import kv_cache_dtype_name
from hloserve.runtime.paths import cache_dir, made_once

from .config import SERVE_QUANTIZE, ServeConfig
from .services import LLMService, build_service
from .wiring import load_runner

DEFAULT_PRESET = "smollm2-135m-instruct"
# How the default model is exported, and the cache directory's suffix naming it (a cache
# written with other flags, or by an exporter whose step or files have changed since, is never
# mistaken for this one: "s7" = decode attention as the hloserve.paged_attention composite, version 1,
# the 16-bit matrices read in place through the hloserve.layer_linear composite, version 1, q/k/v and
# gate/up each one fused matrix with rows grouped for tensor parallelism (exporter/llm/hf_layers.py
# FusedLinear), and a preset's recommended sampling in the artifact's generation_config.json).
DEFAULT_EXPORT_FLAGS = ("--weight-dtype", "bfloat16", "--kv-cache-dtype", "bfloat16")
EXPORT_STEP = "s7"
DEFAULT_EXPORT_TAG = f"bf16-{EXPORT_STEP}"
# --kv-cache-dtype -> its part of the cache tag where the stored format changed under the same flag:
# int8 rows with a zero point since 2026-11-28, their keys smoothed (exporter/llm/kv_smooth.py) from
# later that day, quantized from the f32 K/V (not from their bf16 rounding) since 2026-11-29 (an older
# "kvint8", "kvint8zp" or "kvint8ks" export is never taken for one); fp8_e4m3 rows since 2026-11-29
# ("kvfp8_e4m3")
KV_EXPORT_TAGS = {"int8": "int8f"}
# --quantize -> its part of the cache tag where the stored format changed under the same flag: a GGUF's
# own blocks with Q5_0 kept as 5-bit values and the K-quants' quants interleaved by 16 rows since
# 2026-12-01 ("gguf2"; an older "gguf" export is never taken for one: it serves, slower)
QUANTIZE_EXPORT_TAGS = {"gguf": "gguf2"}
log = logging.getLogger("hloserve.server")


def export_choice(quantize: str, *, default_model: bool, kv_cache_dtype: str | None = None,
                  batch_invariant: bool = False) -> tuple[tuple[str, ...], str]:
    """(export flags, cache tag) of `hloserve serve --quantize [--kv-cache-dtype D]` (see SERVE_QUANTIZE;
    D: the export's --kv-cache-dtype, None: bfloat16, as llama.cpp keeps a GGUF's K and V in 16 bits: a
    GGUF alone would export an f32 cache, whose reads cost a quantized step at 16 sequences ~15%, its
    lead over bf16 weights included; docs/performance.md, 2026-11-30);
    `batch_invariant`: exported with --batch-invariant (what `serve --speculative-config` exports: its
    verifying steps then give plain decoding's greedy tokens), in a cache of its own ("-bi2": the
    second version, norms' sums included; "-bi" exports made before it are not reused)."""
    if batch_invariant:
        flags, tag = export_choice(quantize, default_model=default_model, kv_cache_dtype=kv_cache_dtype)
        return (*flags, "--batch-invariant"), f"{tag}-bi2"
    if quantize == "auto":
        quantize = "bf16" if default_model else "gguf"
    kv_cache_dtype = kv_cache_dtype_name(kv_cache_dtype)     # "fp8" and "fp8_e4m3": one export
    if quantize != "bf16" and kv_cache_dtype is None:
        kv_cache_dtype = "bfloat16"
    kv = () if kv_cache_dtype is None else ("--kv-cache-dtype", kv_cache_dtype)
    kv_tag = "" if kv_cache_dtype is None else f"kv{KV_EXPORT_TAGS.get(kv_cache_dtype, kv_cache_dtype.lower())}-"
    if quantize == "bf16":
        if kv_cache_dtype in (None, "bfloat16"):
            return DEFAULT_EXPORT_FLAGS, DEFAULT_EXPORT_TAG
        return ("--weight-dtype", "bfloat16", *kv), f"bf16-{kv_tag}{EXPORT_STEP}"
    tag = QUANTIZE_EXPORT_TAGS.get(quantize.lower(), quantize.lower().replace(':', '_'))
    return ("--quantize", quantize, *kv), f"{tag}-{kv_tag}{EXPORT_STEP}"


def default_artifact_path(preset: str = DEFAULT_PRESET, tag: str = DEFAULT_EXPORT_TAG) -> str:
    """Where `hloserve serve` keeps the default model's artifact (it may not exist yet)."""
    return os.path.join(cache_dir(), "artifacts", f"{preset}-{tag}")


def default_artifact(preset: str = DEFAULT_PRESET, quantize: str = SERVE_QUANTIZE,
                     kv_cache_dtype: str | None = None, batch_invariant: bool = False) -> str:
    """The default model's artifact, exported into the cache the first time."""
    flags, tag = export_choice(quantize, default_model=True, kv_cache_dtype=kv_cache_dtype,
                               batch_invariant=batch_invariant)
    return exported_artifact(preset, default_artifact_path(preset, tag), flags)


def exported_artifact(source: str, path: str, flags: tuple[str, ...]) -> str:
    """`hloserve export SOURCE FLAGS` into `path`, once (an existing artifact there is used as it is).

    A start killed mid-export (SIGKILL, OOM, a node going away) leaves no half-written artifact
    where the next start looks: the export is written into `PATH.partial-PID` and renamed into
    place when complete, and the next start removes a directory without a manifest and what dead
    processes left. Replicas sharing one cache export once: the others wait on a lock beside it and
    use its artifact (where locks do not reach, e.g. some network filesystems, the first rename wins)."""
    if os.path.exists(os.path.join(path, "manifest.json")):
        return path
    with made_once(path):
        if os.path.exists(os.path.join(path, "manifest.json")):
            return path
        return _export_into(source, path, flags)


def _export_into(source: str, path: str, flags: tuple[str, ...]) -> str:
    from hloserve.runtime.paths import partial_dir, remove_partials
    shutil.rmtree(path, ignore_errors=True)
    remove_partials(path)
    partial = partial_dir(path)
    print(f"[hloserve] first run: exporting {source} ({' '.join(flags)}) to {path} (once; later starts reuse it)",
          file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "hloserve.server.cli", "export", source, "-o", partial, *flags]
    child = subprocess.Popen(cmd, stderr=subprocess.PIPE)
    error = _pass_stderr_through(child.stderr)
    if child.wait() != 0:
        shutil.rmtree(partial, ignore_errors=True)
        if error:                             # the export's own line: what is wrong and the fix
            raise HloserveError(error)
        raise HloserveError(f"exporting {source} failed (see above); run `hloserve serve` again to retry")
    try:
        os.replace(partial, path)
    except OSError:                         # another replica renamed its export into place first
        if not os.path.exists(os.path.join(path, "manifest.json")):
            raise
        shutil.rmtree(partial, ignore_errors=True)
    return path


def _pass_stderr_through(stream) -> str | None:
    """Copies the export child's stderr (its progress) to ours as it comes, except its one-line
    `hloserve: error: ...`, which is returned: `serve` then says what went wrong in one line, its own."""
    error, held = None, b""
    while chunk := stream.read1(65536):
        *lines, held = (held + chunk).split(b"\n")
        out = []
        for line in lines:
            if line.startswith(_ERROR):
                error = line[len(_ERROR):].decode(errors="replace").strip()
            else:
                out.append(line + b"\n")
        if not (_ERROR.startswith(held) or held.startswith(_ERROR)):   # a partial line (a progress bar): now
            out.append(held)
            held = b""
        sys.stderr.buffer.write(b"".join(out))
        sys.stderr.flush()
    if held.startswith(_ERROR):
        return held[len(_ERROR):].decode(errors="replace").strip()
    sys.stderr.buffer.write(held)
    return error


_ERROR = b"hloserve: error: "


def serve_target(target: str | None, quantize: str = SERVE_QUANTIZE, kv_cache_dtype: str | None = None,
                 batch_invariant: bool = False) -> tuple[str, str | None]:
    """(the artifact `hloserve serve TARGET` serves, the model name it defaults to or None).

    TARGET: None (the default model), an artifact directory (served as it is; --quantize must stay
    auto), a .gguf file or a preset name (no path separator, nothing of that name here): exported
    into the cache once per file (path, size, mtime), format and `kv_cache_dtype` (--kv-cache-dtype;
    an artifact directory's cache must already be stored so: ServeConfig.check_kv_cache);
    `batch_invariant`: what is exported here is (export_choice), an artifact directory as it is."""
    if target is None:
        return default_artifact(DEFAULT_PRESET, quantize, kv_cache_dtype, batch_invariant), DEFAULT_PRESET
    if os.path.isdir(target):
        if quantize != "auto":
            raise HloserveError(f"{target} is an exported artifact; --quantize {quantize} applies to a GGUF file or "
                                f"preset (export it again with `hloserve export SOURCE --quantize {quantize}`)")
        return target, None   # build_service checks its cache against --kv-cache-dtype
    flags, tag = export_choice(quantize, default_model=False, kv_cache_dtype=kv_cache_dtype,
                               batch_invariant=batch_invariant)
    if os.path.isfile(target) and target.endswith(".gguf"):
        st = os.stat(target)
        key = f"{os.path.abspath(target)}\0{st.st_size}\0{st.st_mtime_ns}".encode()
        name = os.path.basename(target)[:-len(".gguf")]
        where = f"{name}-{hashlib.sha256(key).hexdigest()[:12]}-{tag}"
        return exported_artifact(target, os.path.join(cache_dir(), "artifacts", where), flags), name
    if not os.path.exists(target) and os.sep not in target and not target.endswith(".gguf"):
        return exported_artifact(target, default_artifact_path(target, tag), flags), target
    return target, None   # build_service says what it is not


def resolve_draft(config: ServeConfig) -> ServeConfig:
    """`config` with its draft model (--speculative-config's "model") an artifact directory: a GGUF file or
    preset named there is exported into the cache as `hloserve serve` would export it."""
    spec = config.speculative_config
    if spec is None or spec.model is None:
        return config
    path, _ = serve_target(spec.model)
    return dataclasses.replace(config, speculative_config=dataclasses.replace(spec, model=path))


def serve(artifact_path: str | None, *, host: str = "127.0.0.1", port: int = 8000, config: ServeConfig | None = None,
          log_level: str = "info", quantize: str = SERVE_QUANTIZE) -> None:
    import functools

    import uvicorn

    from .http.app import create_app
    from .http.bodies import BodyLimits, BoundedH11Protocol

    logging.basicConfig(level=logging.INFO, format="[hloserve] %(message)s")
    for noisy in ("jax", "absl"):   # jax's backend probing (libtpu) and cache chatter: warnings only
        logging.getLogger(noisy).setLevel(logging.WARNING)
    config = config or ServeConfig()
    path, name = serve_target(artifact_path, quantize, config.kv_cache_dtype,
                              batch_invariant=config.speculative_config is not None)
    config = resolve_draft(config)
    if name and not config.served_model_names:   # an exported preset or file keeps its own name
        config = dataclasses.replace(config, served_model_names=(name,))
    print(f"[hloserve] loading {path}", file=sys.stderr, flush=True)
    service = build_service(path, config)
    grpc_port = config.grpc_port_for(llm=isinstance(service, LLMService))   # refused before anything compiles
    limits = BodyLimits(config.max_body_bytes, config.max_body_chunks, config.body_timeout_s)
    app = create_app(service, api_key=config.api_key, limits=limits, metrics_require_key=config.metrics_require_key)
    grpc = None
    if grpc_port:
        from .grpc.tf_serving import GrpcServer
        grpc = GrpcServer(service, host, grpc_port, api_key=config.api_key, max_message_bytes=config.max_body_bytes)

    def warm():
        what = ("compiling every bucket" if isinstance(service, LLMService) else
                "compiling the buckets of its paddable dims; other sizes compile on first use")
        print(f"[hloserve] warming up {service.model_name} ({what}; /ready says 503 until done)",
              file=sys.stderr, flush=True)
        if isinstance(service, LLMService):
            service.warmup(lambda msg: print(f"[hloserve] {msg}", file=sys.stderr, flush=True))
        else:
            service.warmup()
        if service.readiness.ready:
            print(f"[hloserve] {service.model_name}: ready", file=sys.stderr, flush=True)
        else:   # nothing can be served: say why once and leave (a supervisor restarts or reports it)
            failed.append(service.readiness.error)
            server.server.should_exit = True

    failed: list[str] = []
    warming = threading.Thread(target=warm, name="hloserve-warmup", daemon=True)
    server = _DrainingServer(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                            timeout_graceful_shutdown=config.shutdown_grace_s + 5,
                                            http=functools.partial(BoundedH11Protocol, max_chunks=limits.max_chunks)),
                             service, config.shutdown_grace_s, grpc=grpc, on_listening=warming.start)
    api = "the OpenAI API (/v1/completions, /v1/chat/completions)" if isinstance(service, LLMService) else \
        f"TensorFlow Serving's REST API (/v1/models/{service.model_name}:predict)"
    if grpc is not None:
        api += f" and its gRPC API on {grpc.address}"
    print(f"[hloserve] serving {service.model_name} on http://{host}:{port} with {api}", file=sys.stderr, flush=True)
    try:
        server.run()
    finally:
        if warming.is_alive():   # XLA is compiling in that thread: exiting under it aborts the process
            print("[hloserve] interrupted during warm-up; exiting", file=sys.stderr, flush=True)
            os._exit(130)
        service.close()
    if server.exit_signal:   # stopped by a signal: the conventional status, after a clean close
        raise SystemExit(128 + server.exit_signal)
    if failed:
        raise HloserveError(f"{service.model_name}: {failed[0]}")


def follow(artifact_path: str | None, config: ServeConfig, process, quantize: str = SERVE_QUANTIZE) -> None:
    """A multi-host run's process > 0: load the same step, then run every step the leader sends
    until the leader stops (runtime/distributed.py). Serves nothing itself."""
    path, _ = serve_target(artifact_path, quantize, config.kv_cache_dtype,
                           batch_invariant=config.speculative_config is not None)
    art = LLMArtifact.read(path)
    _, runner_cfg, _ = config.resolve(art.llm)
    print(f"[hloserve] process {process.index}/{process.count}: loading {path}", file=sys.stderr, flush=True)
    runner = load_runner(art, runner_cfg, config, strict=False)
    print(f"[hloserve] process {process.index}/{process.count}: running the leader's steps", file=sys.stderr,
          flush=True)
    steps = runner.follow()
    print(f"[hloserve] process {process.index}/{process.count}: the leader stopped after {steps} steps",
          file=sys.stderr, flush=True)


class _DrainingServer:
    """uvicorn with a graceful drain. The first SIGTERM/SIGINT makes /ready answer 503 and new requests
    503 + Retry-After while the listener stays open (a load balancer sees the replica leave), lets
    running requests finish for `grace_s` seconds, then ends what is left cleanly (an error event and
    [DONE] for streams, a JSON 503 otherwise) and only then lets uvicorn close the connections and
    exit. A second signal exits at once.

    The gRPC server, if any, runs in uvicorn's event loop (the predict batcher's): it listens before
    `on_listening` is called (warm-up starts there, so a port in use fails before any compile), is
    counted by the same admission (new calls UNAVAILABLE while draining, running ones waited for) and
    stops after uvicorn."""

    def __init__(self, config, service, grace_s: float, *, grpc=None, on_listening=lambda: None):
        import uvicorn
        self.server = uvicorn.Server(config)
        self.service = service
        self.grace_s = grace_s
        self.grpc = grpc
        self.on_listening = on_listening
        self._handle_exit = self.server.handle_exit
        self.server.handle_exit = self.handle_exit
        self._serve = self.server.serve
        self.server.serve = self.serve
        self.exit_signal = 0

    async def serve(self, sockets=None) -> None:
        """uvicorn's serve, with the gRPC server started first and stopped after, in the same loop."""
        if self.grpc is not None:
            await self.grpc.start()
        self.on_listening()
        try:
            await self._serve(sockets)
        finally:
            if self.grpc is not None:
                await self.grpc.stop()

    def run(self) -> None:
        # Once shut down, uvicorn re-raises the signal that stopped it under the handlers it found
        # installed; these only note it, so the caller still closes the service (which releases a
        # multi-host run's followers) and exits with 128 + the signal afterwards.
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, self._note)
        self.server.run()

    def _note(self, sig, frame) -> None:
        self.exit_signal = sig

    def handle_exit(self, sig, frame) -> None:
        if self.service.readiness.draining or not self.service.readiness.ready:
            self._handle_exit(sig, frame)         # a second signal, or nothing to drain yet: exit now
            return
        self.service.readiness.draining = True
        print(f"[hloserve] shutting down: draining {self.service.admission.in_flight} request(s) for at most "
              f"{self.grace_s:g} s", file=sys.stderr, flush=True)
        threading.Thread(target=self._drain, args=(sig, frame), name="hloserve-drain", daemon=True).start()

    def _drain(self, sig, frame) -> None:
        start = time.monotonic()
        end = start + self.grace_s
        # at least a second (or the grace) with /ready answering 503, so load balancers and probes see the
        # replica leave even when nothing is running
        settle = start + min(1.0, self.grace_s)
        while (self.service.admission.in_flight or time.monotonic() < settle) and time.monotonic() < end:
            time.sleep(0.05)
        if self.service.admission.in_flight and isinstance(self.service, LLMService):
            from .http.errors import SHUTTING_DOWN
            self.service.end_all(SHUTTING_DOWN)
            end = time.monotonic() + 2.0          # the endings reach their clients
            while self.service.admission.in_flight and time.monotonic() < end:
                time.sleep(0.05)
        self._handle_exit(sig, frame)
