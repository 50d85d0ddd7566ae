"""Token outputs -> text outputs: incremental detokenization and stop strings (vLLM keeps both in its
front-end detokenizer, apart from the scheduler's token-level stops).

A request's TextState keeps the text generated so far and how much of it was sent. A stop string
found in the text ends the request there (the text is cut before it, or after it with
include_stop_str_in_output, finish_reason "stop"), and the engine releases the request as it
releases any finished one (its blocks freed before the next step); until a match is ruled out, text that could be the
start of a stop string is held back. The text of EOS / stop tokens is never emitted.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from ..text.tokenizer import Decoder, IncrementalDetokenizer
from .outputs import FinishReason, RequestOutput
from .sampling import SamplingParams


@dataclasses.dataclass
class TextState:
    """One request's text so far (held in the engine's entry for the request)."""
    detok: IncrementalDetokenizer
    stop: tuple[str, ...]
    stop_token_ids: frozenset[int]
    include_stop: bool = False   # keep the stop string that ended the text
    text: str = ""      # generated text, cut before a stop string (after it with include_stop)
    sent: int = 0       # chars of `text` already emitted


class Detokenizer:
    """Fills `new_text` of the engine's outputs; a stop string found in the text finishes the output.

    Stateless across requests: `start` makes a request's TextState, which its owner (the engine's
    entry for the request) keeps and drops with the request."""

    def __init__(self, decoder: Decoder | None):
        self.decoder = decoder

    def check(self, params: SamplingParams) -> None:
        """Raise ValueError (a 400) for a request this detokenizer cannot serve."""
        if params.stop and self.decoder is None:
            raise ValueError("stop strings need a tokenizer to detokenize the output, and this engine has none; "
                             "use stop_token_ids instead")

    def start(self, prompt_token_ids: Sequence[int], params: SamplingParams,
              stop_token_ids: frozenset[int]) -> TextState | None:
        """A new request's text state (None without a decoder: outputs carry token ids only)."""
        if self.decoder is None:
            return None
        return TextState(
            IncrementalDetokenizer(self.decoder, prompt_token_ids, skip_special_tokens=params.skip_special_tokens),
            tuple(params.stop), stop_token_ids, params.include_stop_str_in_output)

    def process(self, st: TextState, out: RequestOutput) -> RequestOutput:
        """`out` with its new text; finished with "stop" when a stop string ended the text here. Tokens
        are read one at a time: when several came in one step (speculative decoding) and a stop string
        ends the text at one of them, the tokens after it are dropped from the output."""
        hit = False
        for i, token in enumerate(out.new_token_ids):
            if token not in st.stop_token_ids:
                st.text += st.detok.step(token)
            if st.stop and self._cut_at_stop(st):
                hit = True
                out = _keep_tokens(out, i + 1)
                break
        reason = FinishReason.STOP if hit else out.finish_reason
        if reason is None:
            hold = max((len(s) for s in st.stop), default=1) - 1   # a stop string may be starting
            upto = max(st.sent, len(st.text) - hold)
            text, st.sent = st.text[st.sent:upto], upto
            return dataclasses.replace(out, new_text=text)
        if not hit:
            st.text += st.detok.flush()                           # a held-back incomplete character, if any
        text = st.text[st.sent:] if reason is not FinishReason.ABORT else ""
        st.sent = len(st.text)
        return dataclasses.replace(out, new_text=text, finish_reason=reason)

    @staticmethod
    def _cut_at_stop(st: TextState) -> bool:
        """Truncate the text before the first stop string; True if one was found."""
        start = max(0, st.sent - max(len(s) for s in st.stop))
        hits = [(j, j + len(s)) for j, s in ((st.text.find(s, start), s) for s in st.stop) if j >= 0]
        if not hits:
            return False
        begin, end = min(hits)
        st.text = st.text[:end if st.include_stop else begin]
        return True


def _keep_tokens(out: RequestOutput, n: int) -> RequestOutput:
    """`out` with only its first n new tokens (and their logprobs), its output count lowered to match."""
    dropped = len(out.new_token_ids) - n
    if not dropped:
        return out
    lps = out.logprobs[:n] if out.logprobs else out.logprobs
    return dataclasses.replace(out, new_token_ids=out.new_token_ids[:n], logprobs=lps,
                               num_output_tokens=out.num_output_tokens - dropped)
