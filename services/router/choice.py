"""One choice of a request: token ids → emitted text (and logprobs), in order.

Text: IncrementalDetokenizer (correct across multi-byte UTF-8) then StopMatcher (stop
strings; the stop string is not returned and ends the choice early). Logprobs of the
tokens that made it into the text are kept; with ``echo`` the prompt (and its logprobs)
comes first, once its logprobs are all in (RequestStream holds tokens back until then).
"""

from __future__ import annotations

from typing import Any

from services.router.in_flight import InFlight
from services.router.logprobs import make_logprobs
from services.router.openai_api import GenerationRequest
from services.router.streams import StreamChunk
from shared.messages import TokenLogprob
from shared.stop_strings import StopMatcher
from shared.tokenizer import IncrementalDetokenizer, Tokenizer


class TextAssembler:
    """Token ids → emitted text for one request. Mutates its own state only."""

    def __init__(self, tokenizer: Tokenizer, req: GenerationRequest) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, list(req.prompt_token_ids))
        self._stops = StopMatcher(req.stop)
        self.num_tokens = 0
        self.receive_times_s: list[float] = []

    @property
    def stopped(self) -> bool:
        return self._stops.stopped

    def push(self, token_ids: list[int], receive_times_s: list[float]) -> str:
        out = []
        for token, recv in zip(token_ids, receive_times_s, strict=True):
            if self._stops.stopped:
                break
            self.num_tokens += 1
            self.receive_times_s.append(recv)
            out.append(self._stops.feed(self._detok.push(token)))
        return "".join(out)

    def finish(self) -> str:
        if self._stops.stopped:
            return ""
        return self._stops.feed(self._detok.flush()) + self._stops.flush()


class Choice:
    """The state of choice ``index`` of a request served by ``entry``."""

    def __init__(
        self, tokenizer: Tokenizer, req: GenerationRequest, entry: InFlight, index: int = 0
    ) -> None:
        self.index = index
        self.entry = entry
        self.text = TextAssembler(tokenizer, req)
        self.logprobs = make_logprobs(tokenizer, req.kind, req.logprobs)
        self._tokenizer = tokenizer
        self._req = req
        self._echo_pending = req.echo
        self.finish_reason: str | None = None  # set by the handler at the end
        self.cumulative_logprob = 0.0  # of the tokens in the text (ranks best_of samples)

    def feed(self, chunk: StreamChunk) -> list[str]:
        """New text pieces from ``chunk`` (the echoed prompt first). Mutates self."""
        pieces: list[str] = []
        if self._echo_pending:
            self._echo_pending = False
            pieces.append(self._echo())
        before = self.text.num_tokens
        pieces.append(self.text.push(chunk.token_ids, chunk.receive_times_s))
        taken = self.text.num_tokens - before
        lps = chunk.logprobs[:taken]  # empty unless asked (by the client, or best_of ranking)
        self.cumulative_logprob += sum(lp.logprob for lp in lps if lp is not None)
        if self.logprobs is not None:
            for tok, lp in zip(chunk.token_ids[:taken], lps, strict=True):
                self.logprobs.add(tok, lp)
        return pieces

    def _echo(self) -> str:
        prompt = list(self._req.prompt_token_ids)
        if self.logprobs is not None:
            plps: dict[int, TokenLogprob] = self.entry.stream.prompt_logprobs
            for pos, tok in enumerate(prompt):
                self.logprobs.add(tok, plps.get(pos) if pos else None)
        return self._tokenizer.decode(prompt)

    def take_logprobs(self) -> dict[str, Any] | None:
        return None if self.logprobs is None else self.logprobs.take()
