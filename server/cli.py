"""The `hloserve` command line: the one module that knows every package.

    hloserve export SOURCE -o OUT [--dynamic SPEC] [--dtype D] [--weight-dtype D] [--kv-cache-dtype D] [--quantize Q] ...
    hloserve tf ART -o SAVEDMODEL [--function F] [--xla-call-module-version N] [--platforms P]
    hloserve inspect ART
    hloserve run ART --inputs in.npz --outputs out.npz [--function F]
    hloserve bench ART --shape INPUT:2x16 [--shape DIM=N] [--function F] [--iters N]
    hloserve serve [ART] [--port P] [--max-num-seqs N] ...

Each subcommand belongs to its package's `commands` module, and only the chosen one is imported (so
`serve`, `run` and `bench` never import torch). Errors print one line and exit 1 (2 for usage
errors); --debug shows tracebacks.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from typing import Sequence

COMMANDS = {  # name -> (owning module, one-line help)
    "export": ("hloserve.exporter.commands", "export a checkpoint to an artifact directory"),
    "tf": ("hloserve.exporter.commands", "convert an artifact to a TensorFlow SavedModel (XlaCallModule) for TF Serving"),
    "inspect": ("hloserve.runtime.commands", "show an artifact's functions, shapes and weights"),
    "run": ("hloserve.runtime.commands", "run an artifact function on inputs from an .npz file"),
    "bench": ("hloserve.runtime.commands", "compile time, latency p50/p99 and throughput of an artifact function"),
    "serve": ("hloserve.server.commands", "serve an artifact over HTTP (OpenAI API for LLMs, TF Serving predict otherwise)"),
}


# Commands whose process holds torch's and jax's global state. Tearing that down at exit (torch's
# custom-op libraries unregistered one by one, jax's caches cleared) takes ~1.5 s and frees nothing
# the OS does not, so the console script ends these processes directly once their output is flushed.
ENDS_DIRECTLY = frozenset({"export", "tf"})


def build_parser(chosen: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hloserve", description="Export PyTorch models to StableHLO and serve them.")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = p.add_subparsers(dest="command", required=True)
    for name, (module, help_) in COMMANDS.items():
        if name == chosen:
            importlib.import_module(module).add_parser(sub, name)
        else:
            sub.add_parser(name, help=help_)
    return p


def command_of(argv: Sequence[str]) -> str | None:
    """The subcommand word of `argv` (its first argument that is not an option)."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv                      # accepted before or after the subcommand
    argv = [a for a in argv if a != "--debug"]
    chosen = command_of(argv)
    args = build_parser(chosen if chosen in COMMANDS else None).parse_args(argv)
    args.debug = debug
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        print("hloserve: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the CLI's one-line error contract
        if args.debug:
            raise
        from hloserve.runtime.artifact.errors import HloserveError
        if isinstance(e, HloserveError):
            msg = str(e)
        else:
            msg = f"internal error: {type(e).__name__}: {e} (run with --debug for the traceback)"
        print(f"hloserve: error: {' '.join(msg.split())}", file=sys.stderr)
        return 1


def run() -> None:
    """The console script: main() on sys.argv, then exit (directly for ENDS_DIRECTLY commands)."""
    code = main()
    if command_of(sys.argv[1:]) in ENDS_DIRECTLY:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
