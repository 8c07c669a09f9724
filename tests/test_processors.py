"""The batched logits processors (dsde_core/processors.py) against their per-row definition
(tests/reference_sampling.process_row): ragged spans, mixed processors, drafts, min_tokens crossing a span, tables
updated over several steps, rows handed on to new requests, tables that grow."""

from __future__ import annotations

import random

import torch

from dsde_core.config import SamplingParams
from dsde_core.processors import HELD, Processors, Span
from dsde_core.syncs import SyncCounter
from tests.reference_sampling import process_row

V = 50
PARAMS = [
    SamplingParams(),  # nothing to process
    SamplingParams(presence_penalty=0.6, frequency_penalty=0.8, repetition_penalty=1.5),
    SamplingParams(logit_bias={3: 4.0, 17: -3.0, 40: 2.5}),
    SamplingParams(min_tokens=6, stop_token_ids=(0, 7)),
    SamplingParams(repetition_penalty=0.5, logit_bias={5: 2.0}, min_tokens=3, stop_token_ids=(5,)),
    SamplingParams(frequency_penalty=-2.0),
]


class _Row:
    """A request of the random cases: its params, prompt and output so far."""

    def __init__(self, rng: random.Random, slot: int, procs: Processors, vocab: int = V) -> None:
        self.params = rng.choice(PARAMS)
        self.prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 8))]
        self.output: list[int] = []
        procs.open(slot, self.params, len(self.prompt))


def _step(rng: random.Random, procs: Processors, rows: dict[int, _Row], vocab: int = V,
          seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One step over the open rows (each a draft level or a verify row at random, its output grown first) -> (what
    the tables make of the packed logits, what the per-row definition makes of them)."""
    spans, want, chunks = [], [], []
    for slot, row in rows.items():
        row.output += [rng.randrange(8) for _ in range(rng.randint(0, 3))]  # few distinct tokens: counts above 1
        drafts = [rng.randrange(min(vocab, 60)) for _ in range(rng.randint(0, 4))]
        n, first = (1, len(drafts)) if rng.random() < 0.5 else (len(drafts) + 1, 0)
        logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed * 97 + slot))
        spans.append(Span(slot, n, row.prompt + row.output, drafts, first))
        chunks.append(logits)
        want.append(process_row(logits, row.params, row.prompt, row.output, drafts, first))
    logits = torch.cat(chunks)
    kept = logits.clone()
    with torch.inference_mode():  # as the workers call it (a release comes outside)
        got = procs.process(logits, spans)
    assert torch.equal(logits, kept)  # a new tensor
    return got, torch.cat(want)


def test_a_batch_is_processed_as_each_row_alone_step_after_step() -> None:
    """Requests come and go over 12 steps (a released row's table row goes to the next request)."""
    for seed in range(12):
        rng, procs = random.Random(seed), Processors()
        rows = {slot: _Row(rng, slot, procs) for slot in range(rng.randint(1, 5))}
        for step in range(12):
            got, want = _step(rng, procs, rows, seed=seed * 100 + step)
            assert torch.equal(got, want), (seed, step)  # the same ops on the same values
            if rng.random() < 0.3:
                slot = rng.choice(list(rows))
                procs.release(slot)
                rows[slot] = _Row(rng, slot, procs)


def test_the_tables_grow_for_more_requests_and_tokens() -> None:
    """20 requests (past the first 8 rows) with prompts of ~100 distinct tokens (past the first 64 columns)."""
    rng, procs = random.Random(5), Processors()
    rows = {}
    for slot in range(20):
        rows[slot] = _Row(rng, slot, procs, vocab=1000)
        rows[slot].params = SamplingParams(presence_penalty=0.5, repetition_penalty=1.3, logit_bias={999: 1.0})
        rows[slot].prompt = [rng.randrange(1000) for _ in range(120)]
        procs.open(slot, rows[slot].params, 120)
    for step in range(3):
        got, want = _step(rng, procs, rows, vocab=1000, seed=step)
        assert torch.equal(got, want), step
    assert procs.table.shape[0] >= 20 and procs.table.shape[2] >= 100


def test_rows_without_processors_pass_through() -> None:
    procs = Processors()
    procs.open(0, SamplingParams(), 0)
    procs.open(1, SamplingParams(logit_bias={4: 1.0}), 0)
    logits = torch.randn(5, V)
    assert procs.process(logits, [Span(None, 2), Span(0, 3)]) is logits
    out = procs.process(logits, [Span(None, 2), Span(1, 1), Span(0, 2)])
    assert torch.equal(out[[0, 1, 3, 4]], logits[[0, 1, 3, 4]])
    assert torch.equal(out[2, [3, 4, 5]], logits[2, [3, 4, 5]] + torch.tensor([0.0, 1.0, 0.0]))


def test_stop_tokens_are_held_only_under_min_tokens() -> None:
    """min_tokens 4, 2 output tokens committed, a verify row of 3 positions: positions 0 and 1 (2 and 3 tokens
    before them) hold the stop tokens, position 2 (4 before it) does not."""
    procs = Processors()
    procs.open(0, SamplingParams(min_tokens=4, stop_token_ids=(1, 9)), 3)
    out = procs.process(torch.zeros(3, V), [Span(0, 3, [5, 6, 7, 8, 8], [2, 3])])
    assert out[:2, [1, 9]].eq(HELD).all() and out[2].eq(0).all() and out[:2, 0].eq(0).all()


def test_processing_reads_nothing_back() -> None:
    rng, procs = random.Random(3), Processors()
    rows = {slot: _Row(rng, slot, procs) for slot in range(4)}
    _step(rng, procs, rows)
    spans = [Span(slot, 2, r.prompt + r.output + [1], [2]) for slot, r in rows.items()]
    with SyncCounter() as c:
        procs.process(torch.randn(8, V), spans)
    assert c.total == 0, c.syncs


def test_drafts_on_the_device_count_as_the_spans_drafts_do() -> None:
    """A draft level's drafts given as a device tensor [N, L] (-1 pads) process as the same drafts in the spans do:
    drafts of tokens the rows have columns for, of new tokens, repeated, and none."""
    for seed in range(8):
        rng = random.Random(seed)
        host, device = Processors(), Processors()
        rows = {slot: _Row(rng, slot, host) for slot in range(rng.randint(1, 5))}
        for slot, row in rows.items():
            device.open(slot, row.params, len(row.prompt))
        for step in range(4):
            spans, drafted = [], []
            for slot, row in rows.items():
                row.output += [rng.randrange(8) for _ in range(rng.randint(0, 3))]
                d = [rng.randrange(12) for _ in range(rng.randint(0, 4))]  # tokens the output holds, and others
                spans.append(Span(slot, 1, row.prompt + row.output, d, len(d)))
                drafted.append(d)
            width = max(map(len, drafted))
            padded = torch.tensor([[*d, *[-1] * (width - len(d))] for d in drafted], dtype=torch.long)  # [N, L]
            logits = torch.randn(len(rows), V, generator=torch.Generator().manual_seed(seed * 10 + step))
            with torch.inference_mode():
                want = host.process(logits, spans)
                got = device.process(logits, [Span(s.slot, 1, s.committed, (), s.first) for s in spans], padded)
            assert torch.equal(got, want), (seed, step)
            assert torch.equal(want, torch.cat([process_row(logits[i : i + 1], rows[s.slot].params,
                                                            rows[s.slot].prompt, rows[s.slot].output, s.drafts,
                                                            s.first) for i, s in enumerate(spans)]))
