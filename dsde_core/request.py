"""A request's state inside the engine, its statistics, and what the engine emits for it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dsde_core.config import SamplingParams, SpeculationParams
from dsde_core.detokenize import TextStream
from dsde_core.sampling import TokenLogprob


@dataclass
class RequestStats:
    """Per-request speculation and latency figures."""

    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    finish: float | None = None
    steps: int = 0  # target verification steps this request took part in
    drafted: int = 0
    accepted: int = 0
    sl: list[int] = field(default_factory=list)  # tokens proposed at each step
    proposed_at: list[int] = field(default_factory=list)  # [j]: steps that proposed a token at draft position j
    accepted_at: list[int] = field(default_factory=list)  # [j]: of those, the ones accepted
    token_times: list[float] = field(default_factory=list)  # emission time of each output token

    def record_step(self, proposed: int, accepted: int) -> None:
        self.steps += 1
        self.drafted += proposed
        self.accepted += accepted
        self.sl.append(proposed)
        grow = proposed - len(self.proposed_at)
        if grow > 0:
            self.proposed_at += [0] * grow
            self.accepted_at += [0] * grow
        for j in range(proposed):
            self.proposed_at[j] += 1
            self.accepted_at[j] += j < accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target step: accepted drafts plus the correction or bonus token."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    @property
    def mean_sl(self) -> float:
        return sum(self.sl) / len(self.sl) if self.sl else 0.0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finish is None else self.finish - self.arrival

    @property
    def itl(self) -> float | None:
        """Mean inter-token latency after the first token."""
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "mean_sl": self.mean_sl,
            "sl": list(self.sl),
            "accepted_per_position": [a / p for a, p in zip(self.accepted_at, self.proposed_at, strict=True)],
            "ttft_s": self.ttft,
            "itl_s": self.itl,
            "e2e_s": self.e2e,
        }


@dataclass
class RequestOutput:
    """What one step emitted for one request."""

    req_id: str
    token_ids: list[int]  # new tokens this step
    text: str  # new text this step
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    error: str | None = None
    stats: RequestStats | None = None  # set on the last output of a request
    error_type: str | None = None  # with an error: "unavailable" (a worker did not come back in time) or None
    logprobs: list[TokenLogprob] | None = None  # one per token in token_ids, where the request asks for them
    prompt_logprobs: list[TokenLogprob] | None = None  # on the first output: one per prompt token after the first
    stop_reason: int | str | None = None  # vLLM's: the stop_token_ids token or the stop string that ended it


@dataclass
class Request:
    req_id: str
    prompt_ids: list[int]
    params: SamplingParams
    spec: SpeculationParams
    detok: TextStream
    on_output: Callable[[RequestOutput], None] | None = None
    output_ids: list[int] = field(default_factory=list)
    slot: int | None = None
    synced_draft: int = 0  # tokens of prompt + output the draft worker has been sent
    synced_target: int = 0
    draft_gap: int = 0  # a draft prefill fed in chunks: context tokens sent to the draft that it has not taken in yet
    chunked: bool = False  # the target holds the first synced_target tokens of a prefill fed in chunks (not all yet)
    scored: list[TokenLogprob] = field(default_factory=list)  # prompt log-probabilities of the prefill's chunks so far
    draft_off: bool = False  # the draft raised on this request alone DRAFT_TRIES times: target-only to its end
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop_token_ids token or the stop string that ended it
    error: str | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token, where params ask for them
    prompt_logprobs: list[TokenLogprob] | None = None  # one per prompt token after the first, once computed

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self.detok.text

    def remaining(self) -> int:
        return self.params.max_tokens - len(self.output_ids)

    @property
    def draft_prefilling(self) -> bool:
        """The draft's cache lacks the context: empty (it never drafted, or the draft restarted) or being chunked."""
        return self.synced_draft == 0 or self.draft_gap > 0

    def draft_context(self, drafting: bool, window: int | None = None) -> int:
        """Context tokens the draft takes in when it is next fed this sequence: all unsent tokens but the last (the
        draft's first forward), except for a sequence that drafts from a warm cache, whose unsent tokens are its
        accepted drafts (already cached). An empty cache (never drafted, or the draft restarted) means a prefill, of at
        most `window` tokens (EngineConfig.draft_window); a prefill in chunks has its gap and the unsent tokens left."""
        if self.synced_draft == 0:
            lag = max(self.num_tokens - 1, 0)
            return min(lag, window) if window is not None else lag  # a windowed prefill
        if self.draft_gap:
            return self.draft_gap + self.num_tokens - self.synced_draft
        return 0 if drafting else max(self.num_tokens - self.synced_draft - 1, 0)
