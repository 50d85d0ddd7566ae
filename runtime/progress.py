"""Progress display for long operations (export stages, weight streaming, compiles).

`Reporter` prints stages with elapsed time and byte/step bars to stderr; the
`quiet` reporter does nothing (library use, tests).
"""
from __future__ import annotations

import contextlib
import sys
import time
from typing import Callable, Iterator


class Reporter:
    def __init__(self, enabled: bool = True, prefix: str = "hloserve"):
        self.enabled = enabled
        self.prefix = prefix
        self._t0 = time.perf_counter()

    def stage(self, message: str) -> None:
        if self.enabled:
            print(f"[{self.prefix} {time.perf_counter() - self._t0:7.1f}s] {message}", file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def bar(self, total: float, description: str, unit: str = "B") -> Iterator[Callable[[float], None]]:
        """A progress bar; yields `advance(amount)`."""
        if not self.enabled:
            yield lambda amount: None
            return
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TransferSpeedColumn,
        )
        columns = [TextColumn(f"[{self.prefix}] {description}"), BarColumn()]
        columns += [DownloadColumn(), TransferSpeedColumn()] if unit == "B" else [MofNCompleteColumn()]
        columns.append(TimeElapsedColumn())
        from rich.console import Console
        with Progress(*columns, console=Console(stderr=True), transient=False) as p:
            task = p.add_task(description, total=total)
            yield lambda amount: p.advance(task, amount)


QUIET = Reporter(enabled=False)
