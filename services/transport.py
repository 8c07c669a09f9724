"""How a draft proposal crosses between processes: the same values, packed per proposal instead of per position.

A Proposal holds one DraftDist per drafted position, each with three [K] tensors; pickled as they are, a batch of
8 sequences drafting 10 tokens is 240 small tensors each way, each paying its own serialization overhead. Packed, a
proposal is three [k, K] tensors plus the entropies and confidences, and the receiving side gets DraftDists that are
row views of them. Nothing is computed or rounded: the target verifies exactly the distributions the draft sampled from.

`register()` installs the packing for Ray's serializer in the calling process; only processes that send
proposals need it (the draft host, and the ingress, which forwards them to the target inside VerifyTasks). The
receiving side needs nothing: the unpacking function travels by reference.
"""

from __future__ import annotations

from typing import Any

import torch

from dsde_core.sampling import DraftDist
from dsde_core.workers import Proposal


def pack(p: Proposal) -> tuple[Any, ...]:
    if not p.dists:
        return (p.slot, list(p.tokens), None, None, None, [], list(p.conf))
    ids = torch.stack([d.ids for d in p.dists])  # [k, K]
    q_sample = torch.stack([d.q_sample for d in p.dists])
    q_signal = torch.stack([d.q_signal for d in p.dists])
    return (p.slot, list(p.tokens), ids, q_sample, q_signal, [d.entropy for d in p.dists], list(p.conf))


def unpack(state: tuple[Any, ...]) -> Proposal:
    slot, tokens, ids, q_sample, q_signal, entropy, conf = state
    if ids is None:
        return Proposal(slot, tokens, [], conf)
    dists = [DraftDist(ids[j], q_sample[j], q_signal[j], entropy[j]) for j in range(len(entropy))]
    return Proposal(slot, tokens, dists, conf)


def register() -> None:
    """Pack Proposals in everything this process sends through Ray (a no-op without Ray)."""
    import ray
    from ray.util import register_serializer

    if ray.is_initialized():
        register_serializer(Proposal, serializer=pack, deserializer=unpack)
