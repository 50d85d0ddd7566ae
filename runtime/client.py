"""The one place that talks to jax/PJRT about platforms, devices and the compile cache.

A `Client` is the platform, the devices a model runs on, and the persistent
compilation cache directory. PJRT clients come from jaxlib (CPU) or from jax's
PJRT plugins (`pip install hloserve[cuda]` / `hloserve[tpu]`); we never build
one by hand.

jax keeps the persistent cache directory and its thresholds in process-wide
config, so the cache is per process: the last `connect` with a cache dir wins.
`compile_events()` counts jax's compile and cache events for the whole process
(one listener, installed on first use); executables read it around their own
compiles to learn whether the persistent cache was hit.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Any, Mapping, Sequence

import jax

LOG = logging.getLogger("hloserve.runtime")
from hloserve.runtime.artifact.errors import HloserveError

from ._private import reset_compilation_cache
from .paths import cache_dir

# jax platform names for what users type; "gpu" means whichever GPU plugin is installed.
_ALIASES = {"cuda": "gpu", "rocm": "gpu", "gpu": "gpu", "cpu": "cpu", "tpu": "tpu"}
_EXTRAS = {"gpu": "hloserve[cuda]", "tpu": "hloserve[tpu]"}

# XLA:CPU's dot library: which library fusion its dots compile to. "xla" is XLA's own emitter;
# "ynn" (the YNNPACK fusion the flag named xnn selects in this XLA) and "onednn" are XLA:CPU's
# experimental library fusions. On an AMD EPYC (2026-11-23) "ynn" ran an isolated bf16 dot ~2x
# faster, but whole LLM steps and MiniLM within this machine's noise of "xla", and "onednn" slower
# prefill steps (docs/performance.md, "CPU dot libraries"); so the default stays "xla".
# $HLOSERVE_CPU_DOTS picks another, e.g. to measure them on a new CPU.
CPU_DOT_LIBRARIES = {
    "xla": {},
    "ynn": {"xla_cpu_experimental_xnn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"},
    "onednn": {"xla_cpu_experimental_onednn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"},
}
DEFAULT_CPU_DOTS = "xla"

# XLA:GPU's options for every executable on a GPU: XLA's defaults. On an H200 (2026-11-30) the 1B
# step was no faster with its layer loop unrolled, with CUDA graphs over the loop, or both
# (docs/performance.md). $HLOSERVE_XLA_OPTIONS adds or overrides options on any platform.
GPU_OPTIONS: dict[str, str] = {}

# Sentinel: the default persistent cache directory (see default_cache_dir()).
DEFAULT_CACHE = "default"


class PlatformError(HloserveError):
    """The requested platform or devices are not available."""


def parse_xla_options(text: str) -> dict[str, str]:
    """`name=value;name=value` (XLA DebugOptions fields, as in XLA_FLAGS without the dashes; a value
    may hold commas) -> {name: value}."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, eq, value = part.partition("=")
        name = name.strip().removeprefix("--")
        if not eq or not name.startswith("xla_"):
            raise PlatformError(f"HLOSERVE_XLA_OPTIONS: {part!r} is not name=value with an xla_ option name; "
                                "write e.g. HLOSERVE_XLA_OPTIONS='xla_gpu_graph_min_graph_size=1;"
                                "xla_gpu_enable_command_buffer=FUSION,CUBLAS'")
        value = value.strip()
        # XLA's boolean options take "True"/"False" here (XLA_FLAGS also takes "true")
        out[name] = value.capitalize() if value.lower() in ("true", "false") else value
    return out


def compiler_options(platform: str) -> dict[str, str]:
    """The XLA options executables on `platform` are compiled with: CPU's dot library, GPU_OPTIONS on
    a GPU, then $HLOSERVE_XLA_OPTIONS on top. They are part of the executable-cache key."""
    if platform == "cpu":
        choice = os.environ.get("HLOSERVE_CPU_DOTS", DEFAULT_CPU_DOTS)
        if choice not in CPU_DOT_LIBRARIES:
            raise PlatformError(f"HLOSERVE_CPU_DOTS={choice!r} is not one of {sorted(CPU_DOT_LIBRARIES)}")
        options = dict(CPU_DOT_LIBRARIES[choice])
    else:
        options = dict(GPU_OPTIONS) if platform == "gpu" else {}
    options.update(parse_xla_options(os.environ.get("HLOSERVE_XLA_OPTIONS", "")))
    return options


def default_cache_dir() -> str:
    """The compile caches' directory: xla/ under the cache root (runtime/paths.py)."""
    return os.path.join(cache_dir(), "xla")


@dataclasses.dataclass(frozen=True)
class Client:
    """Where a model runs.

    Attributes:
      platform: jax platform name ("cpu", "gpu", "tpu").
      devices: the devices used, in order (one device without a mesh).
      cache_dir: persistent compilation cache directory, or None when disabled.
      compiler_options: XLA options every executable of this client is compiled with
        (`compiler_options(platform)`); they change the code, never the artifact.
    """
    platform: str
    devices: tuple[Any, ...]
    cache_dir: str | None
    compiler_options: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def describe(self) -> str:
        kinds = sorted({getattr(d, "device_kind", self.platform) for d in self.devices})
        return f"{self.platform} x{len(self.devices)} ({', '.join(kinds)})"


def host_devices(count: int) -> None:
    """Make the CPU platform show `count` devices (each a share of the host's cores), so a mesh of
    that many runs on a CPU-only machine; call before jax first touches a backend. Has no effect on
    other platforms' devices, and none when jax is already configured for more."""
    if count > jax.config.jax_num_cpu_devices:
        try:
            jax.config.update("jax_num_cpu_devices", count)
        except RuntimeError:   # a backend is already up: the mesh check then says what is missing
            pass


def platform_devices(platform: str | None = None) -> list[Any]:
    """The devices of `platform` ("cpu", "cuda"/"gpu", "rocm", "tpu"; None: jax's default backend)."""
    jplat = None
    if platform is not None:
        jplat = _ALIASES.get(platform.lower())
        if jplat is None:
            raise PlatformError(f"platform {platform!r} is unknown; use one of cpu, cuda, rocm, gpu, tpu")
    try:
        return jax.devices(jplat) if jplat else jax.devices()
    except RuntimeError as e:
        have = sorted({d.platform for d in jax.devices()})
        raise PlatformError(f"platform {platform!r} is not available (jax sees {', '.join(have)}); "
                            f"install its PJRT plugin: pip install '{_EXTRAS.get(jplat, 'hloserve')}' ({e})") from None


def connect(platform: str | None = None, devices: Sequence[Any] | None = None,
            cache_dir: str | None = DEFAULT_CACHE) -> Client:
    """Pick the platform and devices and configure the persistent compile cache.

    devices: jax devices, or indices into the platform's devices; default all of them
    (the model uses devices[0] unless a mesh spans more).
    """
    available = platform_devices(platform)
    if devices is None:
        chosen = tuple(available)
    else:
        chosen = []
        for d in devices:
            if isinstance(d, int):
                if not 0 <= d < len(available):
                    raise PlatformError(f"device index {d} is out of range: platform {available[0].platform} "
                                        f"has {len(available)} device(s)")
                chosen.append(available[d])
            else:
                chosen.append(d)
        chosen = tuple(chosen)
        if not chosen:
            raise PlatformError("devices is empty; give at least one device")
    resolved = None
    if cache_dir is not None:
        resolved = os.path.abspath(os.path.expanduser(default_cache_dir() if cache_dir == DEFAULT_CACHE else cache_dir))
        try:
            os.makedirs(resolved, exist_ok=True)
        except OSError as e:   # a read-only or full volume, a path through a file: serve, only slower to start
            LOG.warning("compile cache %s cannot be created (%s); running without it: every start compiles. "
                        "Point HLOSERVE_CACHE at a writable directory to keep compiled executables.",
                        resolved, e.strerror or e)
            resolved = None
    configure_compile_cache(resolved)
    return Client(chosen[0].platform, chosen, resolved, compiler_options(chosen[0].platform))


_CACHE_LOCK = threading.Lock()


def configure_compile_cache(cache_dir: str | None) -> None:
    """Point jax's persistent compilation cache at `cache_dir` (None disables it).

    Thresholds are lowered so that every executable is written, however small or
    quick to compile: a server's first request must not pay for any compile.
    """
    with _CACHE_LOCK:
        current = jax.config.jax_compilation_cache_dir
        enabled = jax.config.jax_enable_compilation_cache
        if cache_dir is None:
            if enabled and current:
                jax.config.update("jax_enable_compilation_cache", False)
                reset_compilation_cache()
            return
        os.makedirs(cache_dir, exist_ok=True)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
        if current != cache_dir or not enabled:
            jax.config.update("jax_enable_compilation_cache", True)
            jax.config.update("jax_compilation_cache_dir", cache_dir)
            reset_compilation_cache()


@dataclasses.dataclass
class CompileEvents:
    """Process-wide counts of jax compile events (monotonic; compare before/after).

    Attributes:
      backend_compiles: XLA compiles requested by jax (persistent cache hits included).
      cache_hits: executables read from the persistent cache.
      cache_misses: executables compiled and written to the persistent cache.
    """
    backend_compiles: int = 0
    cache_hits: int = 0
    cache_misses: int = 0

    def snapshot(self) -> "CompileEvents":
        return dataclasses.replace(self)


_EVENTS_LOCK = threading.Lock()
_EVENTS: list[CompileEvents] = []  # at most one; filled on first use (lazily, lock-guarded)


def compile_events() -> CompileEvents:
    """The process's CompileEvents, installing jax monitoring listeners on first use."""
    with _EVENTS_LOCK:
        if _EVENTS:
            return _EVENTS[0]
        ev = CompileEvents()

        def on_event(name: str, **_: Any) -> None:
            if name == "/jax/compilation_cache/cache_hits":
                ev.cache_hits += 1
            elif name == "/jax/compilation_cache/cache_misses":
                ev.cache_misses += 1

        def on_duration(name: str, _secs: float, **_: Any) -> None:
            if name == "/jax/core/compile/backend_compile_duration":
                ev.backend_compiles += 1

        jax.monitoring.register_event_listener(on_event)
        jax.monitoring.register_event_duration_secs_listener(on_duration)
        _EVENTS.append(ev)
        return ev
