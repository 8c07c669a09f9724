"""The rounds of a repeated cell: the order the policies run in each round and the seeds each round samples with.
Light (no torch): the CLI's flags read ROUND_ORDERS."""

from __future__ import annotations

from collections.abc import Sequence

ROUND_SEED_STRIDE = 10_000
"""At T > 0, round r of a repeated cell samples its requests with seed + r * this (every policy the same seeds within
a round): with one seed, a static k replays one trajectory in every round, so its median run is one draw of its
tokens, and the best static k in hindsight the luckiest of several such draws."""

ROUND_ORDERS = ("alternate", "fixed")


def round_policies(policies: Sequence[str], round_: int, order: str) -> list[str]:
    """The order the policies run in a repeated cell's round (0-based). "fixed": the same every round (the order of
    every run whose results name no round_order). "alternate": every other round reversed, so that a drift within a
    round (the machine entering a slow phase; the engine's cost tables, learnt from the policy before) falls on each
    policy's first and last places in turn instead of on the last policy every round: over a pair of rounds every
    policy's mean place is the same."""
    return list(policies[::-1] if order == "alternate" and round_ % 2 else policies)


def round_seed(seed: int, round_: int, temperature: float) -> int:
    """The sampling seed of a repeated cell's round: a new one each round at T > 0 (ROUND_SEED_STRIDE); greedy
    decoding draws nothing, so T = 0 keeps the seed."""
    return seed + round_ * ROUND_SEED_STRIDE if temperature > 0 else seed
