"""`StructuredOutputManager`: structured output as an engine component between scheduling and
execution (vLLM's name and role): one place compiles a request's grammar (its `GrammarSpec`, from
server/text/grammar.py), one builds the step's masks, one advances the grammars with the sampled tokens.

    matcher = structured.matcher(params)          # at admission: ValueError (a 400) for a bad grammar
    plan = structured.masks(plan, matcher_of)     # between schedule() and execute(): rows that sample
    out = structured.accept(matcher, out)         # after update(): "stop" once the grammar is complete

The scheduler stays token policy: it never sees a grammar. Masks come from llguidance in tens of
microseconds per row (server/text/grammar.py), so they are computed on the engine's loop thread.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

from .outputs import FinishReason, RequestOutput, SchedulerPlan
from .sampling import SamplingParams

if TYPE_CHECKING:
    from ..text.grammar import Grammars, Matcher


class StructuredOutputManager:
    """The engine's structured-output component over one model's Grammars (None: no tokenizer).
    The engine holds it as `engine.structured`."""

    def __init__(self, grammars: "Grammars | None"):
        self.grammars = grammars

    def prepare(self) -> str | None:
        """Build the grammar tokenizer now (server start); returns why structured output is
        unavailable, or None."""
        return self.grammars.prepare() if self.grammars is not None else None

    def matcher(self, params: SamplingParams) -> "Matcher | None":
        """A fresh matcher for a request that asks for structured output (None otherwise)."""
        if params.structured is None:
            return None
        if self.grammars is None:
            raise ValueError("structured output needs the model's tokenizer, and this artifact ships none")
        return self.grammars.matcher(params.structured)   # ValueError for a bad grammar

    @staticmethod
    def masks(plan: SchedulerPlan, matcher_of: Callable[[str], "Matcher | None"]) -> SchedulerPlan:
        """The plan with each sampling row's grammar mask (`RowContext.allowed`) filled in."""
        rows, masked = [], False
        for seq in plan.seqs:
            m = matcher_of(seq.request_id) if seq.needs_logits else None
            if m is not None:
                seq = dataclasses.replace(seq, context=dataclasses.replace(seq.context, allowed=m.allowed()))
                masked = True
            rows.append(seq)
        return dataclasses.replace(plan, seqs=tuple(rows)) if masked else plan

    @staticmethod
    def accept(matcher: "Matcher", out: RequestOutput) -> RequestOutput:
        """Advance the grammar by the output's tokens; a complete grammar ends the request ("stop",
        ahead of "length" when both happen on the same token)."""
        for token in out.new_token_ids:
            matcher.accept(token)
        if matcher.done and out.finish_reason in (None, FinishReason.LENGTH):
            return dataclasses.replace(out, finish_reason=FinishReason.STOP)
        return out
