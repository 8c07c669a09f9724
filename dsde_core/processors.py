"""Per-request logits processors as tables on the logits' device, applied to a step's packed positions at once.

A request's processors, in vLLM's order: its stop tokens held off under min_tokens, its logit bias, its penalties.
With c_t the number of times token t occurs in the output before a position (the drafts before it included):
    held (the position is under min_tokens), t a stop token:  l_t <- HELD
    logit bias (OpenAI's):  l_t <- l_t + b_t
    repetition (CTRL; as transformers and vLLM), t in the prompt or c_t > 0:  l_t <- l_t / r if l_t > 0 else l_t * r
    frequency and presence (OpenAI's):  l_t <- l_t - c_t * frequency_penalty - [c_t > 0] * presence_penalty
A verified position is processed for exactly the output target-only decoding has there (the drafts before it
accepted), so a step stays lossless.

Only the logits of tokens a request has a reason to change move: its columns, the distinct tokens of its prompt and
output and its biased and stop tokens, and the drafts before a position. Each request that processes owns a row of
one table on the device, [R, FIELDS, M], column j of row r describing token ids[j]:
    ids      the token (ids < 2^24 are exact in fp32, so one float table holds all fields and a step gathers once)
    counts   c: how many times the output holds it
    bias     b
    prompt   1 where the prompt holds it
    stop     1 where it is a stop token (the engine adds the end-of-sequence ids)
A request's row is updated with only the tokens it commits (new columns, prompt marks, count increments: one scatter
each for the whole step). A step then gathers its positions' rows [P, FIELDS, M'] (M': the step's widest row), and
where a penalised request drafts, the drafts before each position d [P, L] (-1 pads) join them: each column counts
the drafts equal to its token, and each draft brings a column of its own (its token's fields from the row's matching
column, if any, its count the table's plus the drafts'), so the drafts may be ids still on the device, drawn by the
level before. The formulas above run on [P, M' + L] and the results are scattered into a copy of the logits. A
column that repeats a token (columns beyond a row's own repeat its first; a draft of a token the row has a column
for, or drafted twice) computes the same totals, so it writes the same value again. Nothing is read back and no op's
shape depends on the data; the work is the columns', not the vocabulary's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dsde_core.config import SamplingParams
from dsde_core.errors import ConfigError
from dsde_core.packet import Packet, Part

HELD = -1e9  # the logit of a token held off (min_tokens): finite, so 0 * logit stays 0 in an entropy
FIELDS = IDS, COUNTS, BIAS, PROMPT, STOP = range(5)  # a table row's fields


def processes(params: SamplingParams) -> bool:
    """Whether a request's logits change before sampling (any of stop holds, logit bias, penalties)."""
    return bool(params.min_tokens and params.stop_token_ids) or bool(params.logit_bias) or params.penalized


@dataclass
class _Request:
    params: SamplingParams
    prompt_len: int
    row: int  # its row of the table
    cols: dict[int, int] = field(default_factory=dict)  # token id -> its column
    pending: list[tuple[int, int, float]] = field(default_factory=list)  # (field, column, value) not written yet
    taken: int = 0  # committed tokens counted so far

    @property
    def produced(self) -> int:
        """Output tokens committed (and counted) so far."""
        return max(self.taken - self.prompt_len, 0)

    def col(self, token: int) -> int:
        """The token's column (a new one, its id pending, the first time)."""
        if token not in self.cols:
            self.cols[token] = len(self.cols)
            self.pending.append((IDS, self.cols[token], float(token)))
        return self.cols[token]

    def take(self, committed: Sequence[int]) -> None:
        """Count the committed tokens not counted yet; with penalties, their columns, prompt marks and counts
        pending."""
        if self.params.penalized:
            for i in range(self.taken, len(committed)):
                self.pending.append((PROMPT if i < self.prompt_len else COUNTS, self.col(committed[i]), 1.0))
        self.taken = len(committed)


@dataclass(frozen=True)
class Span:
    """n consecutive positions of one row of a packed batch: position j follows the request's committed tokens and
    drafts[:first + j]. slot None: the row's request processes nothing."""

    slot: int | None
    n: int
    committed: Sequence[int] = ()
    drafts: Sequence[int] = ()
    first: int = 0


@dataclass(frozen=True)
class Plan:
    """What a step's processed positions read on the device, as parts of its packet (Processors.plan)."""

    width: int  # M': the widest of the positions' rows
    writes: list[tuple[bool, Part, Part]]  # (added, (row, field, column) [u, 3], values [u]): the table's updates
    penalized: bool  # a position's penalties count its drafts
    repetition: bool  # a position has a repetition penalty
    pos: Part  # [P] the processed positions
    table_rows: Part  # [P] each position's table row
    ncols: Part  # [P] its row's columns
    held: Part  # [P] whether it is under min_tokens
    penalties: Part | None  # [P, 3] repetition, frequency, presence
    before: Part | None  # [P, L] the spans' drafts before each position (-1 pads), where penalties count them


class Processors:
    """The processor tables of one worker's requests (the table made on the logits' device when first needed)."""

    def __init__(self) -> None:
        self.requests: dict[int, _Request] = {}  # slot -> the request open there that processes
        self.table: torch.Tensor | None = None  # [R, FIELDS, M]
        self._free: list[int] = []  # rows of the table no request holds (zeroed)
        self._rows = 0  # rows handed out so far

    def open(self, slot: int, params: SamplingParams, prompt_len: int) -> None:
        """A new request at `slot` (nothing kept for one that processes nothing)."""
        self.release(slot)
        if not processes(params):
            return
        row = self._free.pop() if self._free else self._rows
        self._rows = max(self._rows, row + 1)
        req = self.requests[slot] = _Request(params, prompt_len, row)
        req.pending += [(BIAS, req.col(i), b) for i, b in params.logit_bias]
        if params.min_tokens:
            req.pending += [(STOP, req.col(i), 1.0) for i in params.stop_token_ids]

    @torch.inference_mode()  # the table is an inference tensor where the workers made it
    def release(self, slot: int) -> None:
        req = self.requests.pop(slot, None)
        if req is not None:
            if self.table is not None and req.row < self.table.shape[0]:
                self.table[req.row].zero_()
            self._free.append(req.row)

    @torch.inference_mode()
    def process(self, logits: torch.Tensor, spans: Sequence[Span], drafted: torch.Tensor | None = None) -> torch.Tensor:
        """logits [N, V] packed by `spans` -> the logits each position samples from: the processed positions through
        their requests' tables (the module's formulas), the rest as they are; `logits` itself when no row processes
        (else a new tensor, `logits` kept). drafted [N, L] (on the logits' device, -1 pads): the drafts each position
        follows, in place of its span's (a draft level's, drawn on the device by the levels before it). plan, then
        apply, with a packet of their own."""
        pk = Packet()
        plan = self.plan(spans, pk, drafted is not None)
        if plan is None:
            return logits
        pk.send(logits.device)
        return self.apply(logits, plan, pk, drafted)

    def plan(self, spans: Sequence[Span], pk: Packet, drafted: bool = False) -> Plan | None:
        """The host half of `process`: the spans' requests take their committed tokens, and what the step's device
        half reads (table updates, positions, rows, stop holds, penalties, the drafts before each position unless
        `drafted` brings them) goes into the packet -> the plan for `apply`; None where no row processes."""
        pos, reqs, held, before = [], [], [], []  # [P] position, request, held, and drafts before it (from the spans)
        updates: list[tuple[int, int, int, float]] = []  # (row, field, column, value) of the step's requests
        start = 0
        for s in spans:
            req = self.requests.get(s.slot) if s.slot is not None else None
            if req is not None:
                req.take(s.committed)
                updates += [(req.row, f, c, v) for f, c, v in req.pending]
                req.pending.clear()
                for j in range(s.n):
                    pos.append(start + j)
                    reqs.append(req)
                    held.append(req.produced + s.first + j < req.params.min_tokens)
                    before.append(s.drafts[: s.first + j])
            start += s.n
        if not pos:
            return None
        params = [q.params for q in reqs]
        writes = []  # new columns, bias, stop and prompt marks (set), then output counts (added)
        for add in (False, True):
            part = [u for u in updates if (u[1] == COUNTS) == add]
            if part:
                writes.append((add, pk.ints([u[:3] for u in part]), pk.floats([u[3] for u in part])))
        penalized = any(q.penalized for q in params)
        width = max(map(len, before)) if penalized and not drafted else 0
        return Plan(
            width=max(len(q.cols) for q in reqs), writes=writes, penalized=penalized,
            repetition=any(q.repetition_penalty != 1.0 for q in params), pos=pk.ints(pos),
            table_rows=pk.ints([q.row for q in reqs]), ncols=pk.ints([len(q.cols) for q in reqs]), held=pk.bools(held),
            penalties=pk.floats([[q.repetition_penalty, q.frequency_penalty, q.presence_penalty] for q in params])
            if penalized else None,
            before=pk.ints([[*b, *[-1] * (width - len(b))] for b in before]) if width else None)

    @torch.inference_mode()
    def apply(self, logits: torch.Tensor, plan: Plan, pk: Packet, drafted: torch.Tensor | None = None) -> torch.Tensor:
        """The device half of `process`, its inputs from `plan`'s parts of the sent packet: no host value is read and
        nothing is uploaded but the packet."""
        dev = logits.device
        if logits.shape[-1] > 1 << 24:
            raise ConfigError(f"logits processors hold token ids in fp32: a vocabulary of {logits.shape[-1]} > 2^24")
        width = plan.width
        table = self._fit(dev, width)
        for add, where, values in plan.writes:
            r, f, c = pk[where].T  # [u] each
            table.index_put_((r, f, c), pk[values], accumulate=add)
        pos = pk[plan.pos]  # [P]
        t = table.index_select(0, pk[plan.table_rows])[:, :, :width]  # [P, FIELDS, M']
        cols = torch.arange(width, device=dev)
        own = cols < pk[plan.ncols][:, None]  # [P, M']
        t = t.gather(2, torch.where(own, cols, 0)[:, None, :].expand(-1, len(FIELDS), -1))  # beyond: the first's
        if plan.penalized:  # the drafts before each position join its counts
            d = pk[plan.before] if plan.before is not None else drafted  # [P, L], or [N, L]: drafted's rows
            if d is drafted and d is not None and len(d) != len(pos):
                d = d.index_select(0, pos)  # [P, L] the processed positions' rows
            t = self._with_drafts(t, own, d if d is not None and d.shape[1] else None)
        ids, counts = t[:, IDS].long(), t[:, COUNTS]  # [P, C] each, C = M' (+ L where drafts joined)
        at = pos[:, None].expand_as(ids)  # [P, C]
        z = logits[at, ids]  # [P, C]
        z = torch.where((t[:, STOP] > 0) & pk[plan.held][:, None], HELD, z)
        z = z + t[:, BIAS]
        if plan.penalties is not None:
            r, freq, pres = pk[plan.penalties].T[:, :, None]  # [P, 1] each
            if plan.repetition:
                seen = (t[:, PROMPT] > 0) | (counts > 0)
                z = torch.where(seen, torch.where(z > 0, z / r, z * r), z)
            z = z - freq * counts - pres * (counts > 0).float()
        out = logits.clone()
        out[at, ids] = z  # a repeated token writes the value its first copy does
        return out

    @staticmethod
    def _with_drafts(t: torch.Tensor, own: torch.Tensor, d: torch.Tensor | None) -> torch.Tensor:
        """Positions' table columns t [P, FIELDS, M'] (own [P, M']: a row's own, not a repeat) with the drafts before
        each, d [P, L], counted in: each column's count grows by the drafts of its token, and each draft is a column
        of its own, its token's fields from the row's column for it (none: zero) and its count the table's plus the
        drafts' -> [P, FIELDS, M' + L] (a pad repeats the first column)."""
        if d is None:
            return t
        ids = t[:, IDS].long()  # [P, M']
        x = torch.where(d >= 0, d, ids[:, :1])  # [P, L] the drafts' tokens
        match = (x[:, :, None] == ids[:, None, :]) & own[:, None, :]  # [P, L, M']: a row's columns are distinct tokens
        col = match.to(torch.uint8).argmax(-1)  # [P, L] the matching column (0 where none: masked next)
        fx = t.gather(2, col[:, None, :].expand(-1, len(FIELDS), -1)) * match.any(-1)[:, None, :]  # [P, FIELDS, L]
        fx[:, IDS] = x.to(t.dtype)
        out = torch.cat([t, fx], 2)  # [P, FIELDS, M' + L]
        out[:, COUNTS] += (out[:, IDS, :, None].long() == d[:, None, :]).sum(-1)  # each column's token, drafted
        return out

    def _fit(self, dev: torch.device, width: int) -> torch.Tensor:
        """The table on `dev` with a row for every request and at least `width` columns (grown by doubling)."""
        rows, cols = (1, 1) if self.table is None else self.table.shape[::2]
        need_rows, need_cols = max(rows, 8), max(cols, 64)
        while need_rows < self._rows:
            need_rows *= 2
        while need_cols < width:
            need_cols *= 2
        if self.table is None or (need_rows, need_cols) != (rows, cols) or self.table.device != dev:
            grown = torch.zeros(need_rows, len(FIELDS), need_cols, device=dev)
            if self.table is not None:
                grown[:rows, :, :cols] = self.table.to(dev)
            self.table = grown
        return self.table
