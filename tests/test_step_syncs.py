"""Host reads of a whole engine step on the static runners (dsde_core/syncs.py counts them on any device): one read of
each draft level's tokens and distributions, one of the step's verdicts, nothing else; a change that brings a per-row
read or a data-dependent op back into the step fails here."""

from __future__ import annotations

from collections import Counter

import pytest

from dsde_core.config import EngineConfig, SamplingParams
from dsde_core.engine import Engine
from dsde_core.models.static_step import StaticRunner
from dsde_core.policies import make_policy
from dsde_core.syncs import SyncCounter
from dsde_core.workers import DraftWorker, TargetWorker
from tests.tiny import VOCAB, IdTokenizer, random_prompts, tiny_pair

PROCESSED = dict(presence_penalty=0.5, repetition_penalty=1.2, logit_bias={3: 2.0}, min_tokens=50,
                 stop_token_ids=(7,))


def steady_step(policy: str, processed: bool = False) -> tuple[Counter[str], Engine]:
    """The host reads of one step of greedy and sampled rows past their prefills (no prefill or catch-up in it); with
    `processed`, every row has penalties, a logit bias and stop tokens held under min_tokens too."""
    target, draft = tiny_pair()
    config = EngineConfig(max_batch_size=4, max_seq_len=128, dtype="float32", max_sl=4)
    engine = Engine(TargetWorker(StaticRunner(target, 4, 128, 5)),
                    DraftWorker.from_config(StaticRunner(draft, 4, 128, 5), config), make_policy(policy),
                    IdTokenizer(), config, vocab_size=VOCAB)
    for i, p in enumerate(random_prompts(3, seed=2, min_len=8, max_len=12)):
        engine.add_request(p, SamplingParams(max_tokens=60, temperature=0.0 if i % 2 == 0 else 1.0, seed=i,
                                             top_p=0.9 if i == 1 else 1.0, **(PROCESSED if processed else {})))
    for _ in range(3):
        engine.step()
    calls = {id(r): dict(r.runner.calls) for r in (engine.target, engine.draft)}
    with SyncCounter() as c:
        engine.step()
    for r in (engine.target, engine.draft):  # the measured step ran static forwards only
        assert r.runner.calls["eager"] == calls[id(r)]["eager"]
    return c.syncs, engine


@pytest.mark.parametrize("processed", [False, True], ids=["plain", "processed"])
@pytest.mark.parametrize("k", [1, 3])
def test_a_speculative_step_reads_back_once_a_draft_level_and_once_for_its_verdicts(k: int, processed: bool) -> None:
    syncs, engine = steady_step(f"static:{k}", processed)
    assert engine.step_log[-1].ks == [k] * 3  # every row drafted k tokens: k levels
    assert syncs == Counter({"cpu": k, "tolist": k + 1}), syncs  # a level: its copy and that copy's scalars


def test_a_target_only_step_reads_back_once() -> None:
    syncs, _ = steady_step("off")
    assert syncs == Counter({"tolist": 1}), syncs
