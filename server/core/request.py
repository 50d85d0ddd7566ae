"""A request as the scheduler keeps it (core/scheduler.py owns and mutates it), and the context rule
that the scheduler and the HTTP layer both apply."""
from __future__ import annotations

import dataclasses
import enum

from .sampling import SamplingParams
from .spec_decode import DraftLength

# async scheduling (core/engine.py): the token a step in flight will sample, until update() reads it
PLACEHOLDER = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass
class Request:
    """Scheduler-side state of one request (mutable; owned by the scheduler)."""
    request_id: str
    token_ids: list[int]                 # prompt + generated tokens
    num_prompt_tokens: int
    params: SamplingParams
    seed: int                            # explicit RNG seed for every draw of this request
    arrival: int                         # admission priority: smaller = older
    eos_token_ids: frozenset[int]
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0         # tokens whose K/V is in the cache
    num_cached_tokens: int = 0           # of the prompt, tokens served by the prefix cache (last admission)
    num_preemptions: int = 0
    draft: DraftLength | None = None     # speculative decoding: its proposal length (None: off)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens_left(self) -> int:
        """Tokens to compute before the next one can be sampled."""
        return len(self.token_ids) - self.num_computed_tokens

    def ends_in_flight(self, max_model_len: int) -> bool:
        """Async scheduling: whether its token in flight (a PLACEHOLDER) is its last by length
        (max_tokens or the context), so the step after has nothing to run for it (an EOS cannot be
        known ahead: Scheduler.fill drops that row, or update discards its token)."""
        return self.token_ids[-1] == PLACEHOLDER and (self.num_output_tokens >= self.params.max_tokens
                                                      or len(self.token_ids) >= max_model_len)


def context_room(prompt_len: int, max_model_len: int) -> int:
    """The context rule, part one: the tokens a prompt of `prompt_len` leaves for its output (at least
    one, else ValueError). Stated once; the HTTP layer applies it before a request reaches the engine."""
    if prompt_len >= max_model_len:
        raise ValueError(f"the prompt has {prompt_len} tokens, but the model's context is {max_model_len} tokens; "
                         f"shorten the prompt")
    return max_model_len - prompt_len


def check_context(prompt_len: int, max_tokens: int, max_model_len: int, *, name: str = "max_tokens") -> None:
    """The context rule: prompt plus output fit the model's context (ValueError naming `name`, the
    field that set the output's length, and its largest allowed value)."""
    room = context_room(prompt_len, max_model_len)
    if max_tokens > room:
        raise ValueError(f"prompt ({prompt_len} tokens) + {name} ({max_tokens}) = {prompt_len + max_tokens} exceeds "
                         f"the model's context of {max_model_len} tokens; lower {name} to at most {room}")
