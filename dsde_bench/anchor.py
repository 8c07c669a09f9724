"""The external anchor: transformers' own assisted generation (`generate(assistant_model=...)`) on the same pair
and the same prompts, batch 1, so the table shows what a user of transformers would get instead.

Systems:
    hf-assisted            transformers' defaults for the assistant (its generation_config as shipped)
    hf-assisted-heuristic  num_assistant_tokens_schedule="heuristic" (+2 after a fully accepted step, else -1)
    hf-generate            plain generate(), no assistant (optional: transformers' own target-only speed)
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from typing import Any

import torch

from dsde_bench.metrics import RequestRecord

ANCHOR_SYSTEMS: tuple[str, ...] = ("hf-assisted", "hf-assisted-heuristic")
ALL_ANCHOR_SYSTEMS: tuple[str, ...] = (*ANCHOR_SYSTEMS, "hf-generate")


def assistants(draft: Any) -> dict[str, Any]:
    """system name -> the assistant model to pass (None: no assistant)."""
    heuristic = copy.copy(draft)
    heuristic.generation_config = copy.deepcopy(draft.generation_config)
    heuristic.generation_config.num_assistant_tokens_schedule = "heuristic"
    return {"hf-assisted": draft, "hf-assisted-heuristic": heuristic, "hf-generate": None}


@torch.inference_mode()
def run_anchor(target: Any, assistant: Any | None, prompts: Sequence[Sequence[int]], prompt_ids: Sequence[str],
               max_tokens: int, temperature: float, seed: int, pad_token_id: int | None) -> tuple[list[RequestRecord],
                                                                                                   float]:
    """One system over the prompts, one at a time. Returns the per-request records and the wall time."""
    records = []
    t_start = time.perf_counter()
    for i, (ids, pid) in enumerate(zip(prompts, prompt_ids, strict=True)):
        x = torch.tensor([list(ids)])
        kw: dict[str, Any] = {"do_sample": temperature > 0}
        if temperature > 0:
            kw.update(temperature=temperature, top_p=1.0, top_k=0)
            torch.manual_seed(seed + i)
        t0 = time.perf_counter()
        out = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, min_new_tokens=0,
                              assistant_model=assistant, pad_token_id=pad_token_id, **kw)
        e2e = time.perf_counter() - t0
        n = int(out.shape[1] - x.shape[1])
        records.append(RequestRecord(pid, len(ids), n, steps=0, drafted=0, accepted=0, e2e_s=e2e))
    return records, time.perf_counter() - t_start
