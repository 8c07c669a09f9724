"""DraftWorker and TargetWorker: a model runner, its slot KV cache, and sampling, behind a narrow interface.

The engine speaks only this interface, so a worker may be a local object or a Ray actor handle.
What crosses is small: token ids, per-position scalars and the draft's top-K distribution.

Cache sync by prefix match: each worker keeps, per slot, the committed tokens it has been told and the
tokens whose KV sit in its cache. Every call carries the committed tokens the worker has not seen yet;
the worker keeps the longest cached prefix that matches the committed sequence (capped so that the last
committed token is always fed again) and feeds the rest. One rule covers rollback after a rejection,
the draft catching up after a fully accepted step, and rebuilding an empty cache after a restart.
A draft given a window (EngineConfig.draft_window, off by default) starts an empty cache at the last
`window` committed tokens instead of the first: its proposals are verified, so the output stays lossless.
A catch-up task may carry a limit: a prefill fed in chunks (EngineConfig.prefill_chunk) takes in that many tokens a
call, and the prefix match picks up where the last chunk ended.

Sampling, verification and the KLD signal run batched on the device the logits are on: a draft level's
distributions and draws (sampling.draft_inputs, draft_level), the step's rejection sampler (dsde_core/verify.py) and
the KLD at every drafted position, read back in one copy each: the draft's tokens and distributions of all its levels
where k is fixed at plan time (each level is fed the last one's draws on the device, and penalties count them there),
of each level where a row's stop reads its confidences; a step's verdicts. What they read from the host (uniforms,
drafts, sampling parameters, the processors' updates) goes to the device in one packet a pass (dsde_core/packet.py).
The uniforms come from each request's own generator on the host, so a seed draws the same tokens on any device and in
any batch. The per-request logits processors (stop tokens held, logit bias, penalties) go first, for the whole batch
at once over each request's tables on the device (dsde_core/processors.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from dsde_core.config import EngineConfig, SamplingParams
from dsde_core.errors import WorkerStateLost
from dsde_core.models.runner import Runner
from dsde_core.packet import Packet, Part
from dsde_core.policies.adaedl import entropy_confidence, should_stop
from dsde_core.policies.stopping import CONFIDENCE_AS_P, AcceptModel, DraftStop
from dsde_core.processors import Processors, Span
from dsde_core.sampling import (
    DraftDist,
    TokenLogprob,
    batch_probs,
    draft_inputs,
    draft_level,
    draft_uniforms,
    filter_inputs,
    make_generator,
    sample_level,
    signal_temperature,
    token_logprobs,
)
from dsde_core.signals import sparse_kld_at
from dsde_core.verify import draw_uniforms, pack_drafts, verify_batch


@dataclass
class DraftTask:
    slot: int
    new_tokens: list[int]  # committed tokens this worker has not seen yet
    k: int  # tokens to propose at most; 0: only catch the cache up with the committed tokens
    min_confidence: float | None = None  # stop after token t when 1 - sqrt(0.1 * H(q_t)) < min_confidence
    p_next: float | None = None  # the batch's DraftStop decides when this row stops (see Plan.p_next)
    accept_model: AcceptModel = CONFIDENCE_AS_P  # this row's acceptance model in the DraftStop
    worth: float = 1.0  # what a token of this row is worth in the DraftStop (see Plan.worth)
    limit: int | None = None  # a chunk of a prefill (k = 0): take in at most this many context tokens


@dataclass
class Proposal:
    slot: int
    tokens: list[int]  # [k'] proposed, k' <= k
    dists: list[DraftDist]  # [k'] the sparse distribution each token was drawn from
    conf: list[float] = field(default_factory=list)  # [k'] q_signal of each proposed token (its confidence)

    def add(self, token: int, conf: float, dist: DraftDist) -> None:
        """One more drafted token, with its confidence and the distribution it was drawn from."""
        self.tokens.append(token)
        self.conf.append(conf)
        self.dists.append(dist)


@dataclass
class VerifyTask:
    slot: int
    new_tokens: list[int]
    proposal: Proposal | None = None  # None: a plain target step (prefill or target-only decoding)
    prompt_logprobs: int | None = None  # with a fresh slot's prefill: each prompt token's log p and the n likeliest
    partial: bool = False  # a chunk of a prefill: fed and cached, nothing judged (no proposal)


@dataclass
class Verdict:
    slot: int
    tokens: list[int]  # accepted draft tokens + one correction or bonus token
    accepted: int
    kld: list[float]  # [k'] KL(target || draft) at each proposed position (sparse, at the signal temperature)
    logprobs: list[TokenLogprob] | None = None  # one per token, where the request asks for them
    prompt_logprobs: list[TokenLogprob] | None = None  # one per fed committed token after the first, where asked


@dataclass
class _Slot:
    params: SamplingParams
    gen: torch.Generator
    committed: list[int] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)  # committed[offset:...] whose KV are in the cache, in order
    matched: int = 0  # cached[:matched - offset] == committed[offset:matched] is known
    offset: int = 0  # committed tokens before the cache's first (a windowed draft skipped them)
    score_row: torch.Tensor | None = None  # [D]: a prefill chunk's last hidden state, which predicts the next chunk's


class _Worker:
    """Slot bookkeeping shared by both workers."""

    stream = 0
    role = "worker"

    def __init__(self, runner: Runner, window: int | None = None) -> None:
        self.runner = runner
        self.slots: dict[int, _Slot] = {}
        self.processors = Processors()  # the open requests' logits processors (stop holds, bias, penalties)
        self.window = window  # an empty cache takes in at most the last `window` tokens (the draft's; never the target)

    def open(self, slot: int, params: SamplingParams, prompt_len: int = 0, emitted: int = 0) -> None:
        """An empty slot for a request with a prompt of prompt_len tokens that has emitted `emitted` (a reopened slot's
        seeded draws start a stream of their own: make_generator)."""
        self.runner.set_length(slot, 0)
        self.slots[slot] = _Slot(params, make_generator(params.seed, self.stream, emitted=emitted))
        self.processors.open(slot, params, prompt_len)

    def release(self, slot: int) -> None:
        self.slots.pop(slot, None)
        self.processors.release(slot)
        self.runner.set_length(slot, 0)

    def release_all(self) -> None:
        for slot in list(self.slots):
            self.release(slot)

    def num_open(self) -> int:
        return len(self.slots)

    def available(self) -> bool:
        """Whether the worker answers (an in-process worker always does; a proxy to an actor may not)."""
        return True

    def _sync(self, slot: int, new_tokens: list[int]) -> list[int]:
        """Append the committed tokens, roll the cache back to the matching prefix, return what to feed."""
        s = self.slots.get(slot)
        if s is None:  # opened by the engine, unknown here: this worker was restarted and lost its caches
            raise WorkerStateLost(self.role, f"slot {slot} is not open here (the worker was restarted)")
        s.committed.extend(new_tokens)
        if not s.cached and self.window is not None:  # an empty cache starts at the window (RoPE is relative)
            s.offset = s.matched = max(len(s.committed) - 1 - self.window, 0)
        limit = min(s.offset + len(s.cached), len(s.committed) - 1)  # the last committed token is always fed
        m = min(s.matched, limit)  # >= offset: matched starts there, and limit >= offset
        while m < limit and s.cached[m - s.offset] == s.committed[m]:
            m += 1
        del s.cached[m - s.offset:]
        s.matched = m
        self.runner.set_length(slot, m - s.offset)
        return s.committed[m:]


class DraftWorker(_Worker):
    stream = 1
    role = "draft"

    def __init__(self, runner: Runner, top_k: int = 64, logit_noise: float = 0.0,
                 window: int | None = None) -> None:
        super().__init__(runner, window)
        self.top_k = top_k
        self.logit_noise = logit_noise  # experiments: a deliberately weak draft (lossless all the same)
        self._noise_gen = torch.Generator().manual_seed(12345)

    @classmethod
    def from_config(cls, runner: Runner, config: EngineConfig) -> DraftWorker:
        """The draft worker an engine of `config` prices: its top-K, logit noise and window."""
        return cls(runner, config.draft_top_k, config.draft_logit_noise, config.draft_window)

    @torch.inference_mode()
    def propose(self, tasks: list[DraftTask], stop: DraftStop | None = None) -> list[Proposal]:
        """Batched draft levels; row i stops after k_i tokens, at its AdaEDL confidence stop, or where `stop` (the
        cost-aware rule, for rows with p_next) ends it. Each level is one forward of the rows still drafting. Where
        no row's stop or processor reads what it drafts, every row drafts its k and the levels chain on the device
        (_draft_fixed): one read back for the whole call, not one a level."""
        feeds = {t.slot: self._sync(t.slot, t.new_tokens) for t in tasks}
        out = {t.slot: Proposal(t.slot, [], []) for t in tasks}
        reach = {t.slot: t.worth for t in tasks}  # w * pi, pi: the chance that every token drafted so far is accepted
        # sequences with k = 0 only catch up: feed all but the last committed token, which the next step feeds
        catch_up = [t for t in tasks if t.k == 0 and len(feeds[t.slot]) > 1]
        live = [t for t in tasks if t.k > 0]
        batch = [(t.slot, feeds[t.slot]) for t in live] + [(t.slot, feeds[t.slot][:-1][: t.limit]) for t in catch_up]
        if not any(self._reads_drafts(t, stop) for t in live):
            self._draft_fixed(live, batch, out)
            return [out[t.slot] for t in tasks]
        drafted = level = 0
        while batch:
            logits = self._forward(batch)  # [B, V] on the device
            next_batch = []
            prior = torch.tensor([out[t.slot].tokens for t in live], device=logits.device) \
                if level and self._penalized(live) else None  # [B, level] the drafts so far, for the penalties
            _, host, _ = self._level(live, logits[: len(live)], prior, level)
            for t, (x, conf, dist) in zip(live, self._unpack(host.cpu()), strict=True):  # one read a level
                prop = out[t.slot]
                prop.add(x, conf, dist)
                if stop is not None and t.p_next is not None:
                    reach[t.slot] *= stop.accept_prob(conf, t.accept_model)
                stop_here = should_stop(entropy_confidence(dist.entropy), t.min_confidence)  # AdaEDL's early stop
                if len(prop.tokens) < t.k and not stop_here:
                    next_batch.append(t)
            drafted += len(live)
            level += 1
            live = self._cost_aware_cut(next_batch, out, reach, stop, drafted, level)
            batch = [(t.slot, [out[t.slot].tokens[-1]]) for t in live]
        return [out[t.slot] for t in tasks]

    def _reads_drafts(self, t: DraftTask, stop: DraftStop | None) -> bool:
        """Whether row t's next level depends on its drafts' values on the host: a stop by its confidence (AdaEDL's,
        or the cost-aware rule's). Penalties count the drafts on the device (Processors.process's `drafted`)."""
        return t.min_confidence is not None or (stop is not None and t.p_next is not None)

    def _draft_fixed(self, live: list[DraftTask], batch: list[tuple[int, list[int]]],
                     out: dict[int, Proposal]) -> None:
        """Every row of `live` drafts its k tokens: level l + 1 is fed level l's draws on the device (Runner's ids)
        for the rows still drafting (their index travels in level l's packet), and every level's tokens and
        distributions come back in one copy after the last (the catch-up rows of `batch`, after live's, are fed at
        level 0 only)."""
        if not batch:
            return
        logits = self._forward(batch)  # [B, V] on the device: level 0, live's rows and the catch-up rows
        rows, level, drafted = live, 0, None  # drafted [B_l, l]: the rows' drafts so far, where penalties count them
        counted = self._penalized(live)
        drafting, packed = [], []  # per level: its rows, and their [B_l, 3 + 3K] (_level)
        while rows:
            keep = [i for i, t in enumerate(rows) if t.k > level + 1]  # the rows that draft the next level
            tokens, host, pick = self._level(rows, logits[: len(rows)], drafted, level, keep)
            drafting.append(rows)
            packed.append(host)
            level += 1
            if not keep:
                break
            ids = tokens if pick is None else tokens[pick]
            if counted:
                drafted = tokens[:, None] if drafted is None else torch.cat([drafted, tokens[:, None]], 1)
                drafted = drafted if pick is None else drafted[pick]
            rows = [rows[i] for i in keep]
            logits = self._forward([(t.slot, []) for t in rows], ids)  # the tokens from ids
        if not packed:
            return
        order = [t for rows_l in drafting for t in rows_l]
        for t, drawn in zip(order, self._unpack(torch.cat(packed).cpu()), strict=True):  # the one read back
            out[t.slot].add(*drawn)
        for t in live:  # what levels 1.. fed: each row's drafts but its last
            self.slots[t.slot].cached.extend(out[t.slot].tokens[:-1])

    def _forward(self, batch: list[tuple[int, list[int]]], ids: torch.Tensor | None = None) -> torch.Tensor:
        """One draft forward of (slot, tokens fed) rows, one logit row each (ids: the tokens on the device, one a row,
        where the lists are empty) -> [B, V] on the device, noised where the worker adds logit noise; the fed host
        tokens go into each slot's cache record."""
        slots = [slot for slot, _ in batch]
        toks = [[0] for _ in batch] if ids is not None else [t for _, t in batch]
        logits = self.runner.forward(slots, toks, [1] * len(batch), ids=ids)  # [B, V]
        if self.logit_noise > 0:
            noise = torch.randn(logits.shape, generator=self._noise_gen) * self.logit_noise
            logits = logits + noise.to(logits.device, logits.dtype)
        if ids is None:
            for slot, t in batch:
                self.slots[slot].cached.extend(t)
        return logits

    def _penalized(self, rows: list[DraftTask]) -> bool:
        """Whether a row's penalties count its drafts (the processors are then given them)."""
        return any(self.slots[t.slot].params.penalized for t in rows)

    def _level(self, live: list[DraftTask], logits: torch.Tensor, drafted: torch.Tensor | None, level: int,
               keep: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One level's draft tokens for the drafting rows, whose logits are `logits` [B, V] and who have drafted
        `level` tokens each (`drafted` [B, level]: those tokens, on the device, where a row's penalties count them):
        the rows processed for their requests at once (Processors.plan, then apply), the level's distributions and
        draws batched on the device (sampling.draft_inputs, draft_level, sample_level, the uniforms from each
        request's generator), all from one packet -> (tokens [B], the rows packed for one copy [B, 3 + 3K]: token,
        confidence, entropy, ids, q_sample, q_signal, on the device; `keep`, the rows of the next level, as an index
        on the device from the same packet: None where it is every row or not asked for)."""
        slots = [self.slots[t.slot] for t in live]
        pk = Packet()
        plan = self.processors.plan([Span(t.slot, 1, s.committed, (), level) for t, s in zip(live, slots, strict=True)],
                                    pk, drafted is not None)
        inputs = draft_inputs([s.params for s in slots], [t.min_confidence is not None for t in live],
                              min(self.top_k, logits.shape[-1]), pk)
        u = pk.floats(draft_uniforms([None if s.params.greedy else s.gen for s in slots]))  # [B]
        pick = pk.ints(keep) if keep and len(keep) < len(live) else None  # [B']
        pk.send(logits.device)  # the level's one upload
        z = logits if plan is None else self.processors.apply(logits, plan, pk, drafted)  # [B, V]
        dists = draft_level(z, inputs, pk, self.top_k)
        tokens, conf = sample_level(dists, pk[u])
        host = torch.cat([tokens[:, None].double(), conf[:, None].double(), dists.entropy[:, None].double(),
                          dists.ids.double(), dists.q_sample.double(), dists.q_signal.double()], 1)
        return tokens, host, None if pick is None else pk[pick]

    @staticmethod
    def _unpack(host: torch.Tensor) -> list[tuple[int, float, DraftDist]]:
        """Rows packed by _level, read back [B, 3 + 3K] -> (token, confidence, distribution) a row."""
        k = (host.shape[1] - 3) // 3
        return [(int(x), c, DraftDist(row[3 : 3 + k].long(), row[3 + k : 3 + 2 * k].float(),
                                      row[3 + 2 * k :].float(), h))
                for (x, c, h), row in zip(host[:, :3].tolist(), host, strict=True)]

    @staticmethod
    def _cost_aware_cut(live: list[DraftTask], out: dict[int, Proposal], reach: dict[int, float],
                        stop: DraftStop | None, drafted: int, level: int) -> list[DraftTask]:
        """The rows of `live` that draft the next level: the DraftStop decides for the rows it governs."""
        ruled = [t for t in live if t.p_next is not None]
        if stop is None or not ruled:
            return live
        go = stop.next_level([reach[t.slot] for t in ruled], [t.p_next for t in ruled],
                             [t.k - len(out[t.slot].tokens) for t in ruled], drafted, level)
        keep = {t.slot for t, g in zip(ruled, go, strict=True) if g}
        return [t for t in live if t.p_next is None or t.slot in keep]


class TargetWorker(_Worker):
    stream = 2
    role = "target"

    @torch.inference_mode()
    def verify(self, tasks: list[VerifyTask]) -> list[Verdict]:
        """One batched target forward over each sequence's pending tokens and its draft tokens."""
        feeds = []
        for t in tasks:
            drafts = t.proposal.tokens if t.proposal else []
            feeds.append(self._sync(t.slot, t.new_tokens) + drafts)
        ks = [len(t.proposal.tokens) if t.proposal else 0 for t in tasks]
        # rows per sequence: its k+1 verified positions, or every position fed where the prompt's are asked for
        ns = [len(f) if t.prompt_logprobs is not None else k + 1 for t, f, k in zip(tasks, feeds, ks, strict=True)]
        h = self.runner.forward([t.slot for t in tasks], feeds, ns, hidden=True)  # [sum(ns), D]
        ends = list(itertools.accumulate(ns))
        verified = [e - k - 1 + j for t, e, k in zip(tasks, ends, ks, strict=True) if not t.partial
                    for j in range(k + 1)]  # the last k+1 rows of each judged sequence
        logits = self.runner.head(h if len(verified) == len(h) else h[verified]) if verified else None  # [N, V]
        judged = [t for t in tasks if not t.partial]
        verdicts = dict(zip((t.slot for t in judged), self._judge(judged, logits), strict=True))
        out = []
        for t, feed, k, n, end in zip(tasks, feeds, ks, ns, ends, strict=True):
            s = self.slots[t.slot]
            s.cached.extend(feed)
            v = Verdict(t.slot, [], 0, []) if t.partial else verdicts[t.slot]  # a prefill's chunk: nothing judged
            if t.prompt_logprobs is not None:
                v.prompt_logprobs = self._score(s, h[end - n : end], feed, k, t)
            out.append(v)
        return out

    def _score(self, s: _Slot, h: torch.Tensor, feed: list[int], k: int, t: VerifyTask) -> list[TokenLogprob]:
        """The fed context tokens' log-probabilities from their hidden states h [len(feed), D]: row i predicts fed
        token i + 1 (the drafts' rows are the verdict's), the previous chunk's last row this chunk's first token, and
        a chunk's last row the next chunk's. The head makes their logits a few rows at a time."""
        rows, toks = h[: len(feed) - k - 1], feed[1 : len(feed) - k]
        if s.score_row is not None:
            rows, toks = torch.cat([s.score_row[None], rows]), feed[:1] + toks
        s.score_row = h[-1] if t.partial else None
        return token_logprobs(rows, toks, t.prompt_logprobs, self.runner.head)

    def _judge(self, tasks: list[VerifyTask], logits: torch.Tensor) -> list[Verdict]:
        """The verdicts of the judged rows, whose positions' logits are packed in `logits` [N, V] (row i's k_i + 1
        in order). The whole step goes at once, packed (a ragged batch costs what its positions do): the positions
        processed for their requests (Processors.plan, then apply), the sampled rows' distributions
        (sampling.batch_probs), one rejection sampler (verify.verify_batch) and the KLD signal at every drafted
        position, on the logits' device. What they take from the host (the drafts and their distributions, the
        uniforms, the sampling parameters, the processors' updates) goes in one packet, and what they give back comes
        back in one copy."""
        if not tasks:
            return []
        slots = [self.slots[t.slot] for t in tasks]
        drafts = [t.proposal.tokens if t.proposal else [] for t in tasks]
        dists = [t.proposal.dists if t.proposal else [] for t in tasks]
        lens = [len(d) + 1 for d in drafts]
        offsets = [0, *itertools.accumulate(lens)][:-1]
        raws = list(torch.split(logits, lens))  # [k_i + 1, V] each
        pk = Packet()
        plan = self.processors.plan([Span(t.slot, n, s.committed, d)
                                     for t, s, n, d in zip(tasks, slots, lens, drafts, strict=True)], pk)
        greedy = [s.params.greedy for s in slots]
        sampled = [r for r, g in enumerate(greedy) if not g]
        u = torch.zeros(len(tasks), max(lens))  # [R, k + 1]: a sampled row's acceptance uniforms, then its emission one
        for r in sampled:  # (last column)
            draws = draw_uniforms(slots[r].gen, len(drafts[r]))  # [k_r + 1]
            u[r, : len(drafts[r])], u[r, -1] = draws[:-1], draws[-1]
        stacked = [[torch.stack([getattr(x, f) for x in ds]) if ds else None for ds in dists]
                   for f in ("ids", "q_sample")]
        verify_in = [pk.ints(offsets), pk.bools(greedy),
                     *(pk.floats(x) if x.is_floating_point() else pk.ints(x) for x in pack_drafts(drafts, *stacked)),
                     pk.floats(u)]
        probs_in = self._probs_inputs(pk, slots, sampled, lens, offsets, logits.shape[-1])
        kld_in = self._kld_inputs(pk, slots, drafts, dists, offsets)
        pk.send(logits.device)  # the step's one upload
        z = logits if plan is None else self.processors.apply(logits, plan, pk)  # [N, V]
        target = z if probs_in is None else self._target_probs(z, pk, *probs_in, all_sampled=not any(greedy))
        offs, grd, *packed_drafts, uni = (pk[x] for x in verify_in)
        tokens, accepted = verify_batch(target, offs, grd, *packed_drafts, uni, all(greedy))
        kld = self._kld(z, pk, kld_in)  # [D]
        R, width = len(tasks), tokens.shape[1]  # width: k + 1
        host = torch.cat([tokens.flatten().double(), accepted.double(), kld.double()]).tolist()  # the step's one read
        kld_at = list(itertools.accumulate((len(d) for d in drafts), initial=R * (width + 1)))  # [R + 1]
        verdicts = []
        for r, (t, s, raw) in enumerate(zip(tasks, slots, raws, strict=True)):
            a = int(host[R * width + r])
            emitted, n = [int(x) for x in host[r * width : r * width + a + 1]], s.params.logprobs
            lps = None if n is None else token_logprobs(raw, emitted, n)
            verdicts.append(Verdict(t.slot, emitted, a, host[kld_at[r] : kld_at[r + 1]], lps))
        return verdicts

    @staticmethod
    def _probs_inputs(pk: Packet, slots: list[_Slot], sampled: list[int], lens: list[int], offsets: list[int],
                      v: int) -> tuple[Part, list[Part], bool] | None:
        """The sampled rows' positions and their sampling parameters, into the packet (None: no row samples) ->
        (positions [S], [temperature, top_k, top_p, min_p] [S] each, whether any position filters)."""
        if not sampled:
            return None
        pos = pk.ints([offsets[r] + j for r in sampled for j in range(lens[r])])
        return pos, *filter_inputs([slots[r].params for r in sampled for _ in range(lens[r])], v, pk)

    @staticmethod
    def _target_probs(z: torch.Tensor, pk: Packet, pos: Part, params: list[Part], filtered: bool,
                      all_sampled: bool) -> torch.Tensor:
        """z [N, V] with the sampled rows' positions replaced by their sampling distributions p (batch_probs)."""
        at = pk[pos]  # [S]
        probs = batch_probs(z[at], *(pk[x] for x in params), filtered=filtered)  # [S, V]
        return probs if all_sampled else z.index_copy(0, at, probs)

    @staticmethod
    def _kld_inputs(pk: Packet, slots: list[_Slot], drafts: list[list[int]], dists: list[list[DraftDist]],
                    offsets: list[int]) -> tuple[Part, ...] | None:
        """The drafted positions [D], their signal temperatures [D], draft ids and q_signal [D, K], into the packet
        (None: nothing drafted)."""
        pos = [offsets[r] + j for r, d in enumerate(drafts) for j in range(len(d))]
        if not pos:
            return None
        t_sig = [signal_temperature(s.params) for s, d in zip(slots, drafts, strict=True) for _ in d]
        return (pk.ints(pos), pk.floats(t_sig), pk.ints(torch.stack([x.ids for ds in dists for x in ds])),
                pk.floats(torch.stack([x.q_signal for ds in dists for x in ds])))

    @staticmethod
    def _kld(z: torch.Tensor, pk: Packet, parts: tuple[Part, ...] | None) -> torch.Tensor:
        """The signal: KL(p || q) at every drafted position (also after the first rejection), at each request's signal
        temperature, over the packed drafted positions (_kld_inputs), [D] on z's device; p at the K draft ids is
        exp(z_ids - logsumexp(z)): no full-vocabulary softmax."""
        if parts is None:
            return torch.zeros(0, device=z.device)
        pos, t_sig, ids, q_signal = (pk[x] for x in parts)  # [D], [D], [D, K], [D, K]
        zs = z[pos] / t_sig[:, None]  # [D, V]
        p_ids = (zs.gather(-1, ids) - torch.logsumexp(zs, dim=-1, keepdim=True)).exp()  # [D, K]
        return sparse_kld_at(p_ids, q_signal)  # [D]
