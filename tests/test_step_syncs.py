"""Host reads and uploads of a whole engine step on the static runners (dsde_core/syncs.py counts them on any device):
one read of the draft's tokens and distributions for all its levels where k is fixed at plan time (penalties included:
they count the drafts on the device; one a level where a row's stop reads its confidences), one of the step's
verdicts, nothing else; one upload a forward (the runner's packet) and one a sampling pass (each draft level's, the
verdicts'). A change that brings a per-row or per-level read, a data-dependent op or a stray upload back into the
step fails here."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from dsde_core import packet
from dsde_core.config import SamplingParams
from dsde_core.engine import Engine
from dsde_core.models.runner import ModelRunner
from dsde_core.models.static_step import StaticRunner
from dsde_core.syncs import SyncCounter
from dsde_core.workers import DraftTask, DraftWorker
from tests.tiny import random_prompts, static_engine, tiny_pair

BIASED = dict(logit_bias={3: 2.0}, min_tokens=50, stop_token_ids=(7,))  # processors that read no draft
PENALIZED = dict(presence_penalty=0.5, repetition_penalty=1.2, **BIASED)  # penalties count the drafts


def steady_step(policy: str, processed: dict | None = None) -> tuple[SyncCounter, Engine]:
    """The host reads and uploads of one step of greedy and sampled rows past their prefills (no prefill or catch-up
    in it); with `processed`, every row has those processors too."""
    engine = static_engine(policy)
    for i, p in enumerate(random_prompts(3, seed=2, min_len=8, max_len=12)):
        engine.add_request(p, SamplingParams(max_tokens=60, temperature=0.0 if i % 2 == 0 else 1.0, seed=i,
                                             top_p=0.9 if i == 1 else 1.0, **(processed or {})))
    for _ in range(3):
        engine.step()
    calls = {id(r): dict(r.runner.calls) for r in (engine.target, engine.draft)}
    with SyncCounter() as c:
        engine.step()
    for r in (engine.target, engine.draft):  # the measured step ran static forwards only
        assert r.runner.calls["eager"] == calls[id(r)]["eager"]
    return c, engine


@pytest.mark.parametrize("processed", [None, BIASED, PENALIZED], ids=["plain", "biased", "penalized"])
@pytest.mark.parametrize("policy", ["static:1", "static:3", "dsde"])
def test_a_step_of_fixed_k_reads_the_draft_back_once_and_the_verdicts_once(policy: str, processed: dict) -> None:
    c, engine = steady_step(policy, processed)
    assert all(k > 0 for k in engine.step_log[-1].ks)  # every row drafted
    assert c.syncs == Counter({"cpu": 1, "tolist": 2}), c.syncs  # the draft's copy and its scalars; the verdicts


@pytest.mark.parametrize("processed", [None, PENALIZED], ids=["plain", "penalized"])
@pytest.mark.parametrize("policy", ["off", "static:1", "static:3"])
def test_a_step_uploads_once_a_forward_and_once_a_sampling_pass(policy: str, processed: dict,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Each draft level's and the verdicts' host inputs (uniforms, drafts and their distributions, sampling
    parameters, the processors' updates) travel in one packet (packed as on a GPU): the step's uploads are its
    forwards' packets (copy) and one a sampling pass (to)."""
    monkeypatch.setattr(packet, "PACK_ALWAYS", True)
    c, engine = steady_step(policy, processed)
    passes = max(engine.step_log[-1].ks) + 1  # the draft's levels, then the target's verification
    assert c.uploads == Counter({"copy": passes, "to": passes}), c.uploads


def test_a_confidence_stop_costs_one_read_a_draft_level() -> None:
    """AdaEDL's stop reads each level's confidences before the next: one copy a level drafted."""
    c, engine = steady_step("adaedl")
    levels = max(engine.step_log[-1].ks)
    assert levels > 0 and c.syncs == Counter({"cpu": levels, "tolist": levels + 1}), (levels, c.syncs)


def test_a_target_only_step_reads_back_once() -> None:
    c, _ = steady_step("off")
    assert c.syncs == Counter({"tolist": 1}), c.syncs


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_levels_chained_on_the_device_draft_what_a_level_at_a_time_drafts(static: bool) -> None:
    """The draft worker's two loops: levels fed the last one's draws on the device and read back once (every row's k
    fixed), and one read a level (a row's AdaEDL stop reads its confidences; min_confidence 0 never stops a row of this
    vocabulary) draft the same tokens, confidences and distributions, for greedy and seeded rows of ragged k beside a
    row that only catches up, over steps with rollback; two rows' penalties count their drafts (on the device, and
    from the host's reads)."""
    _, draft = tiny_pair()
    workers = [DraftWorker(StaticRunner(draft, 4, 64, 5) if static else ModelRunner(draft, 4, 64)) for _ in range(2)]
    prompts = random_prompts(4, seed=5, min_len=6, max_len=10)
    for w in workers:
        for slot, p in enumerate(prompts):
            w.open(slot, SamplingParams(temperature=0.0 if slot % 2 else 0.9, seed=slot,
                                        **(PENALIZED if slot < 2 else {})), len(p))
    committed = {slot: list(p) for slot, p in enumerate(prompts)}
    for step, ks in enumerate(([3, 1, 4, 0], [2, 4, 0, 1], [4, 4, 4, 4])):
        got = []
        for w, conf_stop in zip(workers, (None, 0.0), strict=True):
            tasks = [DraftTask(s, committed[s][len(w.slots[s].committed):], k, min_confidence=conf_stop if k else None)
                     for s, k in enumerate(ks)]
            with SyncCounter() as c:
                got.append(w.propose(tasks))
            if static and step and conf_stop is None:  # (step 0 prefills) a row that stops: no index uploaded
                assert c.uploads == Counter({"copy": max(ks)}), (step, c.uploads)  # (the CPU: unpacked)
        chained, stepped = got
        for a, b in zip(chained, stepped, strict=True):
            assert a.tokens == b.tokens and a.conf == b.conf, (step, a.slot)
            assert all(torch.equal(x.ids, y.ids) and torch.equal(x.q_sample, y.q_sample)
                       and torch.equal(x.q_signal, y.q_signal) for x, y in zip(a.dists, b.dists, strict=True))
            committed[a.slot].append(a.tokens[0] if a.tokens else 7)  # a draft accepted or a correction: roll back
        assert [w.runner.length(s) for s in range(4)] == [workers[1].runner.length(s) for s in range(4)]
