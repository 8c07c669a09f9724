"""How fast is the machine right now? One fixed target forward (batch 1, one query token over PROBE_CONTEXT tokens of
cache), timed: identical work every time, so a change in its time is the machine's, not the engine's.

A shared machine's speed can move in phases of seconds to a minute, and a cell of a few seconds falls in one or
another. `dsde bench` probes before and after every round, so a round that ran in a slow phase says so in the
results (probe_ms).
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # type hints only: `dsde bench --help` reads PROBE_FORWARDS without loading torch
    from dsde_core.engine import Engine
    from dsde_core.models.runner import ModelRunner

PROBE_CONTEXT = 64  # tokens of cache under the timed forward: a short decode step's attention, weights dominate
PROBE_FORWARDS = 3  # forwards a probe times (its median kept): `dsde bench --probe-forwards`'s default


def probe_tokens(n: int, vocab_size: int) -> list[int]:
    """[n] fixed token ids inside the vocabulary."""
    return [(100 + i) % vocab_size for i in range(n)]


def prefill_probe(runner: ModelRunner, slot: int, context: int = PROBE_CONTEXT) -> None:
    """Fill a free slot's cache with `context` fixed tokens (untimed)."""
    runner.set_length(slot, 0)
    runner.forward([slot], [probe_tokens(context, runner.vocab_size)], [1])


def fixed_forward_ms(runner: ModelRunner, slot: int, context: int = PROBE_CONTEXT) -> float:
    """ms of one forward of one token over the slot's `context` prefilled tokens; the slot is rolled back after."""
    t0 = time.perf_counter()
    runner.forward([slot], [probe_tokens(1, runner.vocab_size)], [1])
    ms = 1e3 * (time.perf_counter() - t0)
    runner.set_length(slot, context)
    return ms


def machine_probe(engine: Engine, forwards: int = PROBE_FORWARDS, context: int = PROBE_CONTEXT) -> float | None:
    """Median ms of `forwards` fixed target forwards on a free slot of an idle engine (the engine's step log, cost
    tables and policy see none of it; the slot is left empty). None: forwards 0, or no idle in-process target."""
    runner = getattr(engine.target, "runner", None)
    if forwards < 1 or runner is None or engine.has_unfinished() or not engine.free_slots:
        return None
    slot = engine.free_slots[-1]
    prefill_probe(runner, slot, context)
    times = [fixed_forward_ms(runner, slot, context) for _ in range(forwards)]
    runner.set_length(slot, 0)
    return round(statistics.median(times), 2)
