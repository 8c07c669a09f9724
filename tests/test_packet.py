"""The pass's packet (dsde_core/packet.py): parts of any shape come back exactly, as int64, bool and float32, packed
(the GPU's path: one int32 buffer, one copy) as unpacked (the CPU's); and an engine run packed on the CPU emits what
it emits unpacked."""

from __future__ import annotations

import pytest
import torch

from dsde_core import packet
from dsde_core.config import SamplingParams
from dsde_core.packet import Packet
from dsde_core.syncs import SyncCounter
from tests.tiny import random_prompts, static_engine


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_parts_come_back_exactly_in_their_shapes(packed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packet, "PACK_ALWAYS", packed)
    pk = Packet()
    ids = torch.tensor([[151_935, 0, -1], [7, 2**31 - 1, -(2**31)]])  # int64 values in int32's range
    floats = torch.tensor([1e-30, 3.4e38, -0.0, float("inf"), float("nan"), 0.1])
    values = [0.1, 1 / 3, 0.9, 1.2, 2.0**-140]  # Python floats: rounded to fp32 as torch rounds them
    a, b, c, d = pk.ints(ids), pk.floats(floats), pk.bools([True, False]), pk.floats(values)
    empty, nested = pk.ints([]), pk.floats([[0.5, 0.25]])
    with SyncCounter() as counter:
        pk.send("cpu")
    assert counter.uploads == ({"to": 1} if packed else {})  # the one copy (the CPU's: none)
    assert pk[a].dtype == torch.int64 and torch.equal(pk[a], ids)
    assert pk[b].dtype == torch.float32 and torch.equal(pk[b].view(torch.int32), floats.view(torch.int32))  # bitwise
    assert pk[c].dtype == torch.bool and pk[c].tolist() == [True, False]
    assert torch.equal(pk[d], torch.tensor(values))
    assert pk[empty].shape == (0,) and pk[nested].tolist() == [[0.5, 0.25]]


def test_a_part_is_added_before_the_send_and_read_after_it() -> None:
    pk = Packet()
    part = pk.ints([1])
    with pytest.raises(RuntimeError, match="once it is sent"):
        pk[part]
    pk.send("cpu")
    with pytest.raises(RuntimeError, match="no parts once sent"):
        pk.ints([2])


def test_a_pass_with_nothing_to_send_sends_an_empty_packet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packet, "PACK_ALWAYS", True)
    Packet().send("cpu")


def _generate(policy: str) -> list[list[int]]:
    """Greedy, sampled and penalised requests of ragged speculation on the static runners -> their tokens."""
    engine = static_engine(policy)
    reqs = [engine.add_request(p, SamplingParams(
        max_tokens=24, temperature=0.0 if i % 2 == 0 else 0.9, seed=i, top_p=0.9 if i == 1 else 1.0,
        top_k=5 if i == 3 else 0, **(dict(presence_penalty=0.5, repetition_penalty=1.2, logit_bias={3: 2.0},
                                          min_tokens=6, stop_token_ids=(7,)) if i < 2 else {})))
        for i, p in enumerate(random_prompts(4, seed=4, min_len=6, max_len=12))]
    while engine.has_unfinished():
        engine.step()
    assert any(max(s.ks, default=0) > min(s.ks, default=0) for s in engine.step_log) or policy.startswith("static")
    return [r.output_ids for r in reqs]


@pytest.mark.parametrize("policy", ["static:3", "dsde"])
def test_an_engine_run_packed_emits_what_it_emits_unpacked(policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    unpacked = _generate(policy)
    monkeypatch.setattr(packet, "PACK_ALWAYS", True)
    assert _generate(policy) == unpacked
