"""Traces for the simulator: everything a speculation policy can observe at temperature 0, recorded once per prompt.

For a prompt, walk the target's greedy output tokens[0..n-1]. At every position i (prefix P_i = prompt +
tokens[:i]) record the draft's greedy rollout of H tokens from P_i, and for each rollout token j:
    draft[i][j]    the draft's argmax (what the engine's draft proposes at T = 0)
    kld[i][j]      KL(target || draft) at that position, sparse (the draft's top-K + a rest bin) at the signal
                   temperature 1: exactly the value the engine's target worker reports
    entropy[i][j]  the draft's entropy there (AdaEDL's stop statistic)
    top1[i][j]     the draft's probability of its argmax there, at the signal temperature (its confidence)
A step that starts at position i and proposes k tokens then sees draft[i][:k], kld[i][:k], entropy[i][:k], and
accepts the longest prefix of draft[i] that equals tokens[i:]: the engine's step, replayed without a model.
Positions after a rejection are covered too (the rollout continues on the draft's own tokens, as in the engine).

The rollout at position i is only as long as the engine could ever ask for there: min(H, n - 1 - i).
Recording costs n x (H draft forwards + 1 target forward of H + 1 tokens) per prompt, batched over prompts.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from dsde_core.config import SamplingParams
from dsde_core.errors import ConfigError
from dsde_core.models.runner import ModelRunner
from dsde_core.sampling import draft_dist
from dsde_core.signals import sparse_kld

TRACE_VERSION = 2
_GREEDY = SamplingParams(temperature=0.0)


@dataclass
class SeqTrace:
    id: str
    prompt_tokens: int
    tokens: list[int]  # the target's greedy output, max_tokens long (recorded past an EOS)
    eos_at: int | None  # index of the first EOS in tokens: the engine's output ends before it
    draft: list[list[int]]
    kld: list[list[float]]
    entropy: list[list[float]]
    top1: list[list[float]] = field(default_factory=list)
    prompt: list[int] = field(default_factory=list)  # the prompt's token ids (to rerun it on the real engine)

    def match(self, i: int) -> int:
        """Leading tokens of the draft's rollout at position i that the target accepts (greedy)."""
        m = 0
        for j, d in enumerate(self.draft[i]):
            if i + j >= len(self.tokens) or d != self.tokens[i + j]:
                break
            m += 1
        return m

    @property
    def output_len(self) -> int:
        """Tokens the engine emits for this prompt: up to the first EOS, else all."""
        return len(self.tokens) if self.eos_at is None else self.eos_at


@dataclass
class Trace:
    workload: str
    max_tokens: int
    horizon: int  # H: the longest rollout recorded (the engine's max SL for replays)
    top_k: int
    backend: dict[str, Any]
    seqs: list[SeqTrace]
    version: int = TRACE_VERSION
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for s in d["seqs"]:
            s["kld"] = [[round(v, 6) for v in row] for row in s["kld"]]
            s["entropy"] = [[round(v, 5) for v in row] for row in s["entropy"]]
            s["top1"] = [[round(v, 5) for v in row] for row in s["top1"]]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Trace:
        if d.get("version") != TRACE_VERSION:
            raise ConfigError(f"trace version {d.get('version')} is not {TRACE_VERSION}: record it again")
        seqs = [SeqTrace(**s) for s in d["seqs"]]
        return cls(d["workload"], d["max_tokens"], d["horizon"], d["top_k"], d["backend"], seqs, d["version"],
                   d.get("meta", {}))

    def save(self, path: str | Path) -> None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_json()))

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        return cls.from_json(json.loads(Path(path).read_text()))


@torch.inference_mode()
def record(target: ModelRunner, draft: ModelRunner, prompts: Sequence[Sequence[int]], ids: Sequence[str],
           max_tokens: int, horizon: int, eos_ids: Iterable[int] = (), top_k: int = 64,
           slots: Sequence[int] | None = None, workload: str = "", backend: dict[str, Any] | None = None,
           progress: Any = None) -> Trace:
    """Record the trace of every prompt, batched over `slots` (default: all of the runners' slots).

    The runners' caches at those slots are overwritten and left empty (length 0): call this only while the engine
    that owns them runs nothing.
    """
    if horizon < 1 or max_tokens < 1:
        raise ConfigError(f"horizon and max_tokens must be >= 1, got {horizon} and {max_tokens}")
    slots = list(slots if slots is not None else range(min(target.cache.num_slots, draft.cache.num_slots)))
    eos = frozenset(eos_ids)
    seqs: list[SeqTrace] = []
    for start in range(0, len(prompts), len(slots)):
        chunk = list(zip(prompts[start:start + len(slots)], ids[start:start + len(slots)], strict=True))
        seqs += _record_chunk(target, draft, chunk, slots[: len(chunk)], max_tokens, horizon, eos, top_k, progress)
    return Trace(workload, max_tokens, horizon, top_k, dict(backend or {}), seqs)


@dataclass
class _Roll:
    """One prompt's recording state at position i: the draft's rollout from P_i and the target's rows over it."""

    prompt: list[int]
    seq: SeqTrace
    drafts: list[int] = field(default_factory=list)  # rollout tokens d_1..d_h
    klds: list[float] = field(default_factory=list)
    ents: list[float] = field(default_factory=list)
    top1: list[float] = field(default_factory=list)
    argmax: list[int] = field(default_factory=list)  # target argmax after P_i + d_1..d_j, j = 0..h
    last_probs: torch.Tensor | None = None  # target probabilities after the whole rollout (for the next KLD)


def _record_chunk(target: ModelRunner, draft: ModelRunner, chunk: list[tuple[Sequence[int], str]], slots: list[int],
                  max_tokens: int, horizon: int, eos: frozenset[int], top_k: int, progress: Any) -> list[SeqTrace]:
    """Positions advance in lockstep over the chunk's prompts. When the rollout's first token was the target's
    token (the common case), the next position's rollout is this one shifted by one token plus one new draft
    token, and its target rows are this one's plus one: one draft and one single-token target forward instead of
    H draft forwards and an (H + 1)-token target forward. Invariants after position i (L = len(P_i), h = the
    rollout length): the draft cache holds P_i + d_1..d_{h-1} (L + h - 1 entries), the target cache
    P_i + d_1..d_h (L + h)."""
    prompts = [list(p) for p, _ in chunk]
    for p in prompts:
        need = len(p) + max_tokens + horizon
        if need > target.cache.max_seq_len or need > draft.cache.max_seq_len:
            raise ConfigError(f"prompt ({len(p)} tokens) + max_tokens + horizon = {need} exceeds the runners' "
                              f"max_seq_len {min(target.cache.max_seq_len, draft.cache.max_seq_len)}")
    rolls = [_Roll(p, SeqTrace(pid, len(p), [], None, [], [], [], [], list(p)))
             for p, (_, pid) in zip(prompts, chunk, strict=True)]
    for s in slots:
        target.set_length(s, 0)
        draft.set_length(s, 0)
    try:
        for i in range(max_tokens):
            h = min(horizon, max_tokens - 1 - i)  # the engine never drafts past max_tokens
            full, ext = [], []
            for b, r in enumerate(rolls):
                if i > 0 and r.drafts and r.drafts[0] == r.seq.tokens[-1]:
                    _shift(r)  # the rollout from P_i is the last one minus its first token
                    if len(r.drafts) < h:
                        ext.append(b)
                else:
                    full.append(b)
            _forward(target, draft, rolls, slots, full, ext, h, top_k)
            for r in rolls:
                tok = r.argmax[0]
                if r.seq.eos_at is None and tok in eos:
                    r.seq.eos_at = len(r.seq.tokens)
                r.seq.tokens.append(tok)
                r.seq.draft.append(list(r.drafts))
                r.seq.kld.append(list(r.klds))
                r.seq.entropy.append(list(r.ents))
                r.seq.top1.append(list(r.top1))
            if progress is not None:
                progress(len(slots))
    finally:
        for s in slots:
            target.set_length(s, 0)
            draft.set_length(s, 0)
    return [r.seq for r in rolls]


def _shift(r: _Roll) -> None:
    r.drafts, r.klds, r.ents, r.top1, r.argmax = r.drafts[1:], r.klds[1:], r.ents[1:], r.top1[1:], r.argmax[1:]


def _kld(probs: torch.Tensor, dists: list[Any]) -> list[float]:
    """Sparse KL(target || draft) per rollout position, exactly as the target worker computes it."""
    ids = torch.stack([d.ids for d in dists])
    q_sig = torch.stack([d.q_signal for d in dists])
    return sparse_kld(probs, ids, q_sig).tolist()


def _forward(target: ModelRunner, draft: ModelRunner, rolls: list[_Roll], slots: list[int], full: list[int],
             ext: list[int], h: int, top_k: int) -> None:
    """Full rollouts (h draft forwards, one (h + 1)-token target forward) for `full`; one draft token and one
    single-token target forward for `ext`; batched together."""
    new_dists: dict[int, list[Any]] = {b: [] for b in full + ext}
    feeds: dict[int, list[int]] = {}
    for b in full:
        r = rolls[b]
        n = len(r.prompt) + len(r.seq.tokens)  # L_i
        if r.seq.tokens:
            target.set_length(slots[b], n - 1)
            draft.set_length(slots[b], n - 1)
            feeds[b] = [r.seq.tokens[-1]]
        else:
            feeds[b] = list(r.prompt)
        r.drafts, r.klds, r.ents, r.top1, r.argmax = [], [], [], [], []
    for b in ext:
        feeds[b] = [rolls[b].drafts[-1]]
    # draft: forward 1 for everyone that needs a token, then the full rollouts alone
    live = [b for b in full if h > 0] + ext
    step_feeds = {b: feeds[b] for b in live}
    j = 0
    while live:
        logits = draft.forward([slots[b] for b in live], [step_feeds[b] for b in live], [1] * len(live))
        nxt = []
        for row, b in enumerate(live):
            d = draft_dist(logits[row], _GREEDY, top_k)
            new_dists[b].append(d)
            rolls[b].drafts.append(int(d.ids[0]))
            rolls[b].ents.append(d.entropy)
            rolls[b].top1.append(float(d.q_signal[0]))
            if b in feeds and b not in ext and j + 1 < h:
                nxt.append(b)
        live = nxt
        step_feeds = {b: [rolls[b].drafts[-1]] for b in live}
        j += 1
    # the KLD of an extension's new token uses the target row after the old rollout, which we already have
    for b in ext:
        r = rolls[b]
        r.klds += _kld(r.last_probs[None], new_dists[b])
    # target: full rollouts verify [last, d_1..d_h]; extensions feed their new token for the next row
    order = full + ext
    if not order:
        return
    t_feeds = [feeds[b] + rolls[b].drafts for b in full] + [[rolls[b].drafts[-1]] for b in ext]
    n_logits = [h + 1] * len(full) + [1] * len(ext)
    logits = target.forward([slots[b] for b in order], t_feeds, n_logits)
    row = 0
    for b, n in zip(order, n_logits, strict=True):
        rows = logits[row:row + n]
        row += n
        r = rolls[b]
        probs = torch.softmax(rows, dim=-1)  # signal temperature 1 for greedy requests
        if b in ext:
            r.argmax.append(int(rows[0].argmax()))
        else:
            r.argmax = rows.argmax(-1).tolist()
            if h > 0:
                r.klds = _kld(probs[:h], new_dists[b])
        r.last_probs = probs[-1]
