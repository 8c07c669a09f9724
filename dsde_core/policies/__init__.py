"""Speculation-length policies behind one interface (base.py), plus DSDE's batch SL cap (cap.py).

`make_policy(spec)` turns a CLI-style spec into a policy:
    off                    k = 0: target-only decoding through the same engine
    static[:K]             k = K every step (default 4)
    dsde[:MAX]             DSDE (code variant, project defaults) with the adaptive SL cap: the default
    dsde-nocap[:MAX]       the same without the cap
    dsde-paper[:MAX]       the paper's variant with the cap
    dsde-paper-nocap[:MAX] the paper's variant without the cap
                           MAX: DSDE's upper bound on SL_max (and on the warm-up's doubling), default 20; where a
                           draft token costs a large share of a target step (a CPU), a lower bound pays (BENCHMARKS.md)
    dsde-goodput           cost-aware DSDE: a token drafted while it earns more than its time (goodput.py, stopping.py)
    adaedl                 entropy-based early stopping with an adaptive threshold
    heuristic              transformers' +2 / -1 schedule
    acceptance[:T]         acceptance-rate threshold T (default 0.7)
"""

from __future__ import annotations

from dsde_core.errors import ConfigError
from dsde_core.policies.acceptance import (
    DEFAULT_ACCEPTANCE_THRESHOLD,
    AcceptanceRateConfig,
    AcceptanceRatePolicy,
)
from dsde_core.policies.adaedl import AdaEDLConfig, AdaEDLPolicy, draft_confidence, should_stop
from dsde_core.policies.base import Plan, SeqInfo, SpeculationPolicy, StepFeedback
from dsde_core.policies.cap import CappedPolicy
from dsde_core.policies.dsde import DEFAULT_MIN_SPEC, DSDEConfig, DSDEPolicy
from dsde_core.policies.goodput import GoodputConfig, GoodputPolicy
from dsde_core.policies.heuristic import HeuristicConfig, HeuristicPolicy
from dsde_core.policies.static import DEFAULT_STATIC_K, OffPolicy, StaticConfig, StaticPolicy

# the default: cost-aware, so speculation never costs where no draft length pays (docs/policies.md); "dsde" is the
# paper's method
DEFAULT_POLICY = "dsde-goodput"

POLICY_NAMES: tuple[str, ...] = (
    "off",
    "static",
    "dsde",
    "dsde-nocap",
    "dsde-paper",
    "dsde-paper-nocap",
    "dsde-goodput",
    "adaedl",
    "heuristic",
    "acceptance",
)

_SPEC_FORMS = (
    "off, static[:K], dsde[:MAX], dsde-nocap[:MAX], dsde-paper[:MAX], dsde-paper-nocap[:MAX], dsde-goodput, adaedl, "
    "heuristic, acceptance[:T]"
)
_DSDE_NAMES = ("dsde", "dsde-nocap", "dsde-paper", "dsde-paper-nocap")


def _parse_arg(name: str, arg: str, kind: type) -> int | float:
    try:
        return kind(arg)
    except ValueError:
        raise ConfigError(f"policy {name!r}: cannot read {arg!r} as {kind.__name__}") from None


def make_policy(spec: str = DEFAULT_POLICY) -> SpeculationPolicy:
    """Build a policy from a spec such as "dsde", "static:4" or "acceptance:0.6" (see the module doc)."""
    text = spec.strip().lower()
    name, sep, arg = text.partition(":")
    if sep and name not in ("static", "acceptance", *_DSDE_NAMES):
        raise ConfigError(f"policy {name!r} takes no ':' argument (got {spec!r}); valid: {_SPEC_FORMS}")
    if sep and not arg:
        raise ConfigError(f"policy spec {spec!r} has an empty argument after ':'; valid: {_SPEC_FORMS}")
    policy: SpeculationPolicy
    if name == "off":
        policy = OffPolicy()
    elif name == "static":
        k = _parse_arg(name, arg, int) if sep else DEFAULT_STATIC_K
        policy = StaticPolicy(StaticConfig(k=k))
    elif name in _DSDE_NAMES:
        variant = "paper" if name.startswith("dsde-paper") else "code"
        bound = {}
        if sep:
            max_sl = _parse_arg(name, arg, int)
            if max_sl < DEFAULT_MIN_SPEC:
                raise ConfigError(f"policy {name!r}: MAX (the bound on SL_max) must be >= {DEFAULT_MIN_SPEC}, "
                                  f"DSDE's SL_min; got {max_sl}")
            bound = dict(max_sl=max_sl, init_sl=min(DSDEConfig.init_sl, max_sl))
        policy = DSDEPolicy(DSDEConfig(variant=variant, **bound))
        policy = policy if name.endswith("-nocap") else CappedPolicy(policy)
    elif name == "dsde-goodput":
        policy = GoodputPolicy()
    elif name == "adaedl":
        policy = AdaEDLPolicy()
    elif name == "heuristic":
        policy = HeuristicPolicy()
    elif name == "acceptance":
        threshold = _parse_arg(name, arg, float) if sep else DEFAULT_ACCEPTANCE_THRESHOLD
        policy = AcceptanceRatePolicy(AcceptanceRateConfig(threshold=threshold))
    else:
        raise ConfigError(f"unknown speculation policy {spec!r}; valid: {_SPEC_FORMS}")
    if name != "static":  # StaticPolicy names itself "static:K" (also for a bare "static")
        policy.name = text
    return policy


def ceiling_note(policy: SpeculationPolicy, max_sl: int) -> str | None:
    """A warning where the policy plans k above the engine's max_sl, which lowers each such k without a word."""
    bound = policy.k_bound
    return None if bound is None else above_ceiling(f"policy {policy.name} plans k up to {bound}", bound, max_sl)


def above_ceiling(what: str, bound: int, max_sl: int) -> str | None:
    """The warning where `what` (a policy's plan, a live ceiling) reaches k = bound above the engine's max_sl; None
    within it."""
    if bound <= max_sl:
        return None
    return (f"{what}, above the engine's max_sl {max_sl}: no step drafts more than {max_sl} tokens (raise the "
            f"engine's max_sl, or lower the bound)")


__all__ = [
    "DEFAULT_POLICY",
    "POLICY_NAMES",
    "AcceptanceRateConfig",
    "AcceptanceRatePolicy",
    "AdaEDLConfig",
    "AdaEDLPolicy",
    "CappedPolicy",
    "DSDEConfig",
    "DSDEPolicy",
    "GoodputConfig",
    "GoodputPolicy",
    "HeuristicConfig",
    "HeuristicPolicy",
    "OffPolicy",
    "Plan",
    "SeqInfo",
    "SpeculationPolicy",
    "StaticConfig",
    "StaticPolicy",
    "StepFeedback",
    "above_ceiling",
    "ceiling_note",
    "draft_confidence",
    "make_policy",
    "should_stop",
]
