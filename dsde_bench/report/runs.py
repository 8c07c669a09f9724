"""results/<run>.md: every cell of one run, each policy a row, beside its JSON."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dsde_bench.report.sections import run_line, serve
from dsde_bench.report.tables import CELL, Doc, Rows, by_order, fmt, groups, pivot

COLS = {"mean e2e (s)": "mean_e2e_s", "tok/s": "output_tok_s", "speedup": "speedup", "accept": "acceptance_rate",
        "MAL": "mean_accepted_length", "target fwd/tok": "target_fwd_per_tok", "draft fwd/tok": "draft_fwd_per_tok",
        "SL mean": "sl_mean", "SL sd": "sl_std"}
SIM_COLS = {"target fwd/tok": "target_fwd_per_tok", "vs oracle": "oracle_gap", "draft fwd/tok": "draft_fwd_per_tok",
            "accept": "acceptance_rate", "SL mean": "sl_mean", "SL sd": "sl_std", "sim tok/s": "output_tok_s",
            "speedup": "speedup"}
LEGEND = ("e2e: a request's end-to-end latency; speedup: target-only's mean e2e over this one; accept: accepted / "
          "drafted; MAL: tokens a target step; fwd/tok: forwards per output token; SL: tokens proposed a step; "
          "Static-opt: the static k of the lowest mean e2e; load: 1-min load average; probe ms: the machine probes.")


def cells_table(cells: Sequence[Doc], cols: Mapping[str, str] = COLS) -> str:
    """Every policy of one cell, a row each, with its load and machine probes where the run kept them."""
    rows: Rows = {}
    for c in by_order(cells):
        row = rows[c.get("label", c["policy"])] = {h: fmt(c["metrics"].get(k), ".3f" if "fwd" in k else ".2f")
                                                   for h, k in cols.items()}
        if load := [x for x in c.get("loadavg") or [] if x is not None]:
            row["load"] = f"{max(load):.1f}"
        if ms := [x for r in c.get("probe_ms") or [] for x in r if x is not None]:
            row["probe ms"] = f"{min(ms):.0f}-{max(ms):.0f}"
    return pivot(rows, ["policy"])


def _rounds(cells: list[Doc]) -> str:
    """A repeated cell's rounds, policy by policy: wall seconds and SL mean of each (the median run is the cell's)."""
    rows = {c.get("label", c["policy"]): {"wall s by round": " ".join(f"{x:.2f}" for x in c["walls_s"]),
                                          "SL mean by round": " ".join(f"{x:.2f}" for x in c.get("sl_means") or [])}
            for c in by_order(cells) if len(c.get("walls_s") or []) > 1 and c["policy"] != "static-opt"}
    return f"\n{pivot(rows, ['policy'])}\n" if rows else ""


def _engine(doc: Doc) -> list[str]:
    b, c = doc.get("backend", {}), doc.get("config", {})
    head = (f"{b.get('draft')} drafting for {b.get('target')}, {b.get('dtype')}, max SL {b.get('max_sl')}; "
            f"{c.get('num_prompts')} prompts (seed {c.get('seed')}), max_tokens {c.get('max_tokens')}, "
            f"{c.get('repeats', 1)} round(s) ({c.get('round_order', 'fixed')} order), "
            f"{c.get('warm_requests', 0)} warm-up requests.\n\n{LEGEND}\n")
    return [head] + [f"## {w}, T={t:g}, batch {bs}\n\n{cells_table(cs)}\n{_rounds(cs)}"
                     for (w, t, bs), cs in groups(doc["cells"], CELL).items()]


def _simulator(doc: Doc) -> list[str]:
    warm = doc.get("warm_traces") or []
    traces = {t["workload"]: {k: str(t[k]) for k in ("prompts", "max_tokens", "horizon", "positions")} |
              {"mean accepted run": fmt(t["mean_match"])} for t in doc.get("traces", [])}
    val = {(v["workload"], v["policy"], str(v["batch"])): {"measured": f"{v['measured']:.4f}",
                                                           "predicted": f"{v['predicted']:.4f}",
                                                           "error": f"{100 * v['rel_error']:.2f}%"}
           for v in (doc.get("validation") or {}).get("rows") or []}
    return [f"Traces (and, for a policy that learns across requests, warm-up traces of {warm[0]['prompts']} other "
            "prompts a workload):\n" if warm else "Traces:\n", pivot(traces, ["workload"]) + "\n",
            *([f"## Validation against the engine (target fwd/tok)\n\n{pivot(val, ['workload', 'policy', 'batch'])}\n"]
              if val else []),
            *(f"## {w}, batch {b}, profile {p}\n\n{cells_table(cs, SIM_COLS)}\n"
              for (w, b, p), cs in groups(doc["cells"], ("workload", "batch", "profile")).items())]


def run_page(name: str, doc: Doc) -> str:
    if doc.get("kind") == "serve":
        return serve(doc)
    body = _simulator(doc) if "profiles" in doc else _engine(doc)
    return "\n".join([f"# {name}\n\n{run_line(name, doc, cells=False)}\n", *body])
