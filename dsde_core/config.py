"""Configuration dataclasses: the engine, a request's sampling, a request's speculation.

Each is validated at construction and raises ConfigError naming the field, the value and the range.
Policy configurations live beside their rules in dsde_core.policies.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from dsde_core.errors import ConfigError
from dsde_core.models.backends import BACKENDS, STEPS

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}

MAX_LOGPROBS = 20  # the most alternatives a request may ask for at each position (as vLLM and OpenAI's chat)
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI's range)
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 10.0  # 1: none; a tinier one overflows the logits it divides
MAX_LOGIT_BIAS = 100.0  # a logit bias lies in [-100, 100] (OpenAI's range)
MAX_BIASED_TOKENS = 1024  # token ids one request may bias
MAX_STOP_TOKEN_IDS = 64  # token ids one request may stop on


def is_device(device: object) -> bool:
    """'cpu', 'cuda' or 'cuda:N': where the engine's models run."""
    return isinstance(device, str) and re.fullmatch(r"cpu|cuda(:\d+)?", device) is not None


def _check(cond: bool, msg: str) -> None:
    """ConfigError(msg) unless `cond`; each message leads with the parameter at fault, which the error names as its
    field (a server's 400 names it in `param`)."""
    if not cond:
        raise ConfigError(msg, msg.split(" ", 1)[0])


def _bias_ok(pair: object) -> bool:
    """A (token id, bias) pair: an integer >= 0 and a number in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS]."""
    if not (isinstance(pair, tuple) and len(pair) == 2):
        return False
    i, b = pair
    return type(i) is int and i >= 0 and isinstance(b, (int, float)) and abs(b) <= MAX_LOGIT_BIAS


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. temperature 0 means greedy (and lossless token for token)."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k
    min_p: float = 0.0  # drop the tokens whose probability is under min_p times the likeliest's; 0: none
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()  # end the request as an eos does (dropped unless the next field keeps them)
    include_stop_str_in_output: bool = False  # vLLM's: the stop string or stop_token_ids token that ended it is kept
    min_tokens: int = 0  # the end-of-sequence and stop_token_ids are held off until the output has this many tokens
    skip_special_tokens: bool = True  # vLLM's: special tokens' text is left out of the output text (not its ids)
    logprobs: int | None = None  # None: none; n: each output token's log-probability and the n likeliest (sampling.py)
    prompt_logprobs: int | None = None  # the same for each prompt token after the first (what an echo reports)
    presence_penalty: float = 0.0  # subtracted from the logit of each token the output holds (processors.process)
    frequency_penalty: float = 0.0  # ... times the number of times the output holds it
    repetition_penalty: float = 1.0  # divides a positive logit (multiplies a negative one) of prompt and output tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to that token's logit (a dict is taken)

    def __post_init__(self) -> None:
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1,
               f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _check(0.0 <= self.temperature <= 100.0, f"temperature must be in [0, 100], got {self.temperature!r}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, f"top_k must be an integer >= 0, got {self.top_k!r}")
        _check(isinstance(self.min_p, (int, float)) and 0.0 <= self.min_p <= 1.0,
               f"min_p must be in [0, 1], got {self.min_p!r}")
        _check(type(self.min_tokens) is int and 0 <= self.min_tokens <= self.max_tokens,
               f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        stops = self.stop_token_ids
        _check(isinstance(stops, (tuple, list)) and len(stops) <= MAX_STOP_TOKEN_IDS
               and all(type(t) is int and t >= 0 for t in stops),
               f"stop_token_ids must be at most {MAX_STOP_TOKEN_IDS} token ids (integers >= 0), got {stops!r}")
        object.__setattr__(self, "stop_token_ids", tuple(sorted(set(stops))))
        _check(self.seed is None or isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            _check(v is None or (isinstance(v, int) and 0 <= v <= MAX_LOGPROBS),
                   f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {v!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(isinstance(v, (int, float)) and -MAX_PENALTY <= v <= MAX_PENALTY,
                   f"{name} must be in [{-MAX_PENALTY:g}, {MAX_PENALTY:g}], got {v!r}")
        r = self.repetition_penalty
        _check(isinstance(r, (int, float)) and MIN_REPETITION_PENALTY <= r <= MAX_REPETITION_PENALTY,
               f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}], got {r!r}")
        _check(isinstance(self.logit_bias, (dict, tuple, list)),
               f"logit_bias must be a mapping, got {self.logit_bias!r}")
        pairs = list(self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias)
        _check(len(pairs) <= MAX_BIASED_TOKENS and all(_bias_ok(p) for p in pairs),
               f"logit_bias must map at most {MAX_BIASED_TOKENS} token ids (integers >= 0) to biases in "
               f"[{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {self.logit_bias!r}")
        bias = tuple(sorted((int(i), float(b)) for i, b in pairs))
        object.__setattr__(self, "logit_bias", bias)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        _check(all(isinstance(s, str) and s for s in stop), f"stop must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


@dataclass(frozen=True)
class SpeculationParams:
    """Per-request control of speculation: off, or a ceiling on the speculation length."""

    enabled: bool = True
    max_sl: int | None = None

    def __post_init__(self) -> None:
        _check(self.max_sl is None or (isinstance(self.max_sl, int) and self.max_sl >= 0),
               f"speculation max_sl must be an integer >= 0, got {self.max_sl!r}")


@dataclass(frozen=True)
class EngineConfig:
    """The engine: how many sequences run at once, how long they may grow, what crosses between workers."""

    max_batch_size: int = 8  # KV-cache slots: sequences decoded together
    max_seq_len: int = 2048  # prompt + generated tokens (+ draft lookahead) per slot
    max_sl: int = 20  # global ceiling on the speculation length
    draft_top_k: int = 64  # K: the draft ships its top-K probabilities, never the full vocabulary
    dtype: str = "bfloat16"
    device: str = "cpu"
    backend: str = "auto"  # the runner of both models: "torch", "llama.cpp" or "auto" (dsde_core.models.backends)
    draft_backend: str | None = None  # the draft's, where it differs from `backend`
    # the torch runner's step (dsde_core.models.backends.STEPS): "static" pads decode and verify calls to buckets up to
    # max_batch_size x (1 + max_sl) and, on CUDA, replays them as captured graphs. Opt-in until timed on a GPU
    step: str = "eager"
    num_threads: int | None = None  # torch intra-op threads and llama.cpp's; None: torch's default, every core
    draft_quant: str = "auto"  # draft weights: "int8" (weight-only), "none", or "auto" (int8 for bf16 on CPU)
    draft_catch_up: bool = False  # feed committed tokens to the draft every step, even for sequences with k = 0
    draft_max_lag: int = 32  # otherwise: a k = 0 sequence's draft cache catches up once it lags this many tokens
    # opt-in: a draft cache that starts empty (a prompt) takes in only the last draft_window tokens of the context, so
    # a long prompt's draft prefill stays bounded where a draft token is dear (a CPU: a few hundred tokens keep a
    # draft's recent context); proposals are verified, so output stays lossless. None (default): the whole context
    draft_window: int | None = None
    draft_logit_noise: float = 0.0  # experiments only: Gaussian noise (std, in logits) makes a deliberately weak draft
    extra_eos_ids: tuple[int, ...] = field(default=())
    # chunked prefill: the most context tokens the target's prefills take in one step, in running order, and the same
    # for the draft's (a speculating request's prompt); a longer prefill is fed over several steps, and the running
    # requests decode in each of them. None: no limit. 4096 lies above every benchmark batch's prompts, so the
    # benchmarks run unchunked
    prefill_chunk: int | None = 4096
    worker_wait_s: float = 60.0  # how long requests wait for a failed target to come back before they end in an error
    worker_probe_s: float = 0.2  # how often a failed worker (target, draft, policy host) is asked whether it is back

    def __post_init__(self) -> None:
        _check(1 <= self.max_batch_size <= 1024, f"max_batch_size must be in [1, 1024], got {self.max_batch_size}")
        _check(16 <= self.max_seq_len <= 1 << 20, f"max_seq_len must be in [16, 2^20], got {self.max_seq_len}")
        _check(0 <= self.max_sl <= 64, f"max_sl must be in [0, 64], got {self.max_sl}")
        _check(1 <= self.draft_top_k <= 4096, f"draft_top_k must be in [1, 4096], got {self.draft_top_k}")
        _check(self.dtype in DTYPES, f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        _check(is_device(self.device),
               f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        for name in ("backend", "draft_backend"):
            v = getattr(self, name)
            _check((v is None and name == "draft_backend") or v in BACKENDS,
                   f"{name} must be one of {', '.join(BACKENDS)}, got {v!r}")
        _check(self.step in STEPS, f"step must be one of {', '.join(STEPS)}, got {self.step!r}")
        _check(self.draft_quant in ("auto", "int8", "none"),
               f"draft_quant must be 'auto', 'int8' or 'none', got {self.draft_quant!r}")
        _check(self.draft_max_lag >= 2, f"draft_max_lag must be >= 2, got {self.draft_max_lag}")
        _check(self.draft_window is None or (type(self.draft_window) is int and self.draft_window >= 1),
               f"draft_window must be None (off) or an integer >= 1, got {self.draft_window!r}")
        _check(self.draft_logit_noise >= 0, f"draft_logit_noise must be >= 0, got {self.draft_logit_noise}")
        _check(self.prefill_chunk is None or (type(self.prefill_chunk) is int and self.prefill_chunk >= 1),
               f"prefill_chunk must be None (no limit) or an integer >= 1, got {self.prefill_chunk!r}")
        _check(self.num_threads is None or self.num_threads >= 1, f"num_threads must be >= 1, got {self.num_threads}")
        _check(0 < self.worker_wait_s <= 86400, f"worker_wait_s must be in (0, 86400], got {self.worker_wait_s}")
        _check(0 < self.worker_probe_s <= 60, f"worker_probe_s must be in (0, 60], got {self.worker_probe_s}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def draft_quantize(self) -> str | None:
        """The draft's weight quantization after resolving "auto". Never applies to the target."""
        if self.draft_quant == "auto":
            return "int8" if self.device == "cpu" and self.torch_dtype == torch.bfloat16 else None
        return None if self.draft_quant == "none" else self.draft_quant
