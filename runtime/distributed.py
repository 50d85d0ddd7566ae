"""Several hosts, one program: jax's multi-controller runtime, and the leader's calls replayed.

    process = distributed.initialize()        # every host, before anything touches a device
    model = runtime.load(path, mesh={"model": jax.device_count()}, ...)   # the mesh spans every host
    calls = distributed.CallChannel(model.functions)
    leader:  calls.send("decode", inputs)  then call the function itself
    others:  for name, inputs in calls.receive_all(): call the same function

jax runs one process per host, each driving its own devices; an SPMD program over a mesh that
spans hosts runs only when every process calls it, with the same inputs, in the same order. The
leader (process 0) decides what to run (the server's scheduler); the others receive each call
from it (a header of the inputs' shapes, then the inputs, both through
jax.experimental.multihost_utils.broadcast_one_to_all, i.e. the devices' own collectives) and
make the same call. Outputs come back replicated on every process; the followers drop theirs.

Where processes meet: `initialize` reads JAX_COORDINATOR_ADDRESS (host:port of process 0),
JAX_NUM_PROCESSES and JAX_PROCESS_ID, or, with none of them set, lets jax detect a Cloud TPU
slice, SLURM, Open MPI or Kubernetes job by itself.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Iterator, Mapping

import numpy as np
from hloserve.runtime.artifact.errors import HloserveError

_CALL, _STOP = 1, 2


@dataclasses.dataclass(frozen=True)
class Process:
    """This process's place in the run: index 0 is the leader."""
    index: int
    count: int

    @property
    def is_leader(self) -> bool:
        return self.index == 0


def initialize() -> Process:
    """Join the multi-process run the environment describes (see the module docstring)."""
    import jax

    env = {k: os.environ.get(k) for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")}
    given = {k: v for k, v in env.items() if v}
    if given and len(given) != 3:
        missing = sorted(set(env) - set(given))
        raise HloserveError(f"a multi-host run needs JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and "
                            f"JAX_PROCESS_ID; {', '.join(missing)} not set")
    try:
        if given:
            jax.distributed.initialize(given["JAX_COORDINATOR_ADDRESS"], int(given["JAX_NUM_PROCESSES"]),
                                       int(given["JAX_PROCESS_ID"]))
        else:
            jax.distributed.initialize()
    except (RuntimeError, ValueError) as e:
        raise HloserveError(f"joining the multi-host run failed: {str(e).splitlines()[0]}; set "
                            f"JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID") from None
    return Process(jax.process_index(), jax.process_count())


class CallChannel:
    """The leader's function calls, replayed by every other process (module docstring).

    Only calls of functions whose inputs are all int32 travel (the LLM step's are); the donated
    state (the KV cache) does not: every process passes its own part of it.
    """

    def __init__(self, functions: Mapping[str, Any], *, state: tuple[str, ...] = ()):
        self.names = sorted(functions)
        self.state = set(state)
        # per function: the inputs sent and their ranks (the header carries every dim)
        self._inputs = {n: [(t.name, len(t.shape)) for t in functions[n].spec.inputs if t.name not in self.state]
                        for n in self.names}
        self._header = 2 + max(sum(r for _, r in ins) for ins in self._inputs.values())

    @staticmethod
    def _broadcast(tree: Any) -> Any:
        from jax.experimental import multihost_utils
        return multihost_utils.broadcast_one_to_all(tree)

    def send(self, name: str, inputs: Mapping[str, np.ndarray]) -> None:
        """Leader: announce a call of `name` with `inputs` (call the function after this)."""
        header = np.zeros(self._header, np.int32)
        header[:2] = (_CALL, self.names.index(name))
        dims = [d for n, _ in self._inputs[name] for d in np.shape(inputs[n])]
        header[2:2 + len(dims)] = dims
        self._broadcast(header)
        self._broadcast(tuple(np.asarray(inputs[n], np.int32) for n, _ in self._inputs[name]))

    def stop(self) -> None:
        """Leader: release the followers (their receive_all ends)."""
        header = np.zeros(self._header, np.int32)
        header[0] = _STOP
        self._broadcast(header)

    def receive_all(self) -> Iterator[tuple[str, dict[str, np.ndarray]]]:
        """Followers: every call the leader sends, until it stops."""
        while True:
            header = np.asarray(self._broadcast(np.zeros(self._header, np.int32)))
            if int(header[0]) == _STOP:
                return
            name = self.names[int(header[1])]
            dims, shapes = list(header[2:]), []
            for _, rank in self._inputs[name]:
                shapes.append(tuple(int(d) for d in dims[:rank]))
                dims = dims[rank:]
            values = self._broadcast(tuple(np.zeros(s, np.int32) for s in shapes))
            yield name, {n: np.asarray(v) for (n, _), v in zip(self._inputs[name], values)}
