"""The simulator against the real engine: the same traced prompts run through the engine at temperature 0, and
the predicted target forwards per output token compared with the measured ones, per policy and batch size."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from dsde_bench.backend import Backend
from dsde_bench.metrics import summarize
from dsde_bench.runner import run_cell, sampling_params
from dsde_bench.sim.costs import ProfileCosts, builtin_profile
from dsde_bench.sim.simulator import make_sim_policy, simulate
from dsde_bench.sim.trace import Trace
from dsde_core.errors import ConfigError

TOLERANCE = 0.05


def validate(backend: Backend, traces: Sequence[Trace], policies: Sequence[str], batch_sizes: Sequence[int],
             print_fn: Callable[[str], None] = print) -> dict[str, Any]:
    """Rows of (workload, policy, batch, measured, predicted, rel_error); the engine must use max_sl = horizon."""
    engine = backend.engine
    rows = []
    for tr in traces:
        if engine.config.max_sl != tr.horizon:
            raise ConfigError(f"validation needs the engine's max_sl ({engine.config.max_sl}) equal to the trace's "
                              f"horizon ({tr.horizon}): pass --max-sl {tr.horizon}")
        if any(not s.prompt for s in tr.seqs):
            raise ConfigError(f"trace {tr.workload} has no prompt ids: record it again")
        prompts = [s.prompt for s in tr.seqs]
        ids = [s.id for s in tr.seqs]
        params = sampling_params(len(prompts), tr.max_tokens, 0.0, 0, False)
        for bs in batch_sizes:
            for pol in policies:
                # a cost-aware policy plans with measured time, which no replay reproduces step for step: both sides
                # plan with the same fixed profile instead, so the replay's mechanics are what is checked
                cost = builtin_profile("cpu") if make_sim_policy(pol).cost_aware else None
                online, engine.costs = engine.costs, (ProfileCosts(cost) if cost else engine.costs)
                try:
                    run = run_cell(engine, pol, prompts, ids, params, bs, watch=0)
                finally:
                    engine.costs = online
                measured = summarize(run.records, run.steps, run.wall_s).target_fwd_per_tok
                recs, samples, total = simulate(tr, pol, bs, max_sl=engine.config.max_sl,
                                                num_requests=len(prompts), cost=cost).priced(_UNIT)
                predicted = summarize(recs, samples, total).target_fwd_per_tok
                err = abs(predicted - measured) / measured
                rows.append({"workload": tr.workload, "policy": pol, "batch": bs, "measured": measured,
                             "predicted": predicted, "rel_error": err})
                print_fn(f"validate {tr.workload:8} {pol:12} b={bs:<3} measured {measured:.4f} predicted "
                         f"{predicted:.4f} error {100 * err:.2f}%")
    worst = max((r["rel_error"] for r in rows), default=0.0)
    return {"rows": rows, "max_rel_error": worst, "tolerance": TOLERANCE, "ok": worst <= TOLERANCE}


def _unit_cost() -> Any:
    from dsde_bench.sim.costs import CostModel

    return CostModel("unit", 1.0, 0.0, 0.0, 0.0)


_UNIT = _unit_cost()
