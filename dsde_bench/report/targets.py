"""The benchmarks' targets, each judged from a run's figures (ratios within one run) and named by what it tests. The
best static k is picked in hindsight per cell: by mean latency (Static-opt) for DSDE, by tokens/s for dsde-goodput."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dsde_bench.report.tables import CELL, Doc, Rows, best_static, cell_name, get, groups, pivot
from dsde_core.policies import DEFAULT_POLICY

WITHIN = 0.05  # DSDE with the cap within 5% of the best static k's mean latency
LOW_FLOOR = 0.98  # dsde-goodput's tokens/s against target-only where no static k pays
COLLAPSE = 0.10  # dsde-goodput's tokens/s drops no more than this from one batch size to the next larger
SERVICE_GOAL = 0.9  # the service's tokens/s against the in-process engine's
PEER_TARGET_ONLY = 0.95  # our target-only's tokens/s against llama-server's, on the same backend and files
PERF_BATCH = "chat x4"  # make perf's cell of 4 concurrent requests
ANCHORS = ("hf-assisted", "hf-assisted-heuristic")
GOODPUT, TPUT = "dsde-goodput", "output_tok_s"
LOW = "dsde-goodput never below target-only (>= 0.98x) where no static k pays"
MARK = {True: "✓", False: "✗", None: "·"}


@dataclass(frozen=True)
class Target:
    name: str  # what it tests
    where: str  # the cell, prompt or run it is judged on
    figure: str
    met: bool | None  # None: the run cannot tell (e.g. the cap never bound)


def table(targets: Sequence[Target]) -> str:
    """A row per target, a column per cell (its figure and ✓, ✗ or ·: no verdict), then how many are met."""
    rows: Rows = {}
    for t in targets:
        rows.setdefault(t.name, {})[t.where] = f"{t.figure} {MARK[t.met]}"
    for name, entries in rows.items():
        entries["met"] = tally([t for t in targets if t.name == name])
    return f"Targets, {tally(targets)} met:\n\n{pivot(rows, ['target'], last=['met'])}" if targets else ""


def tally(targets: Sequence[Target]) -> str:
    judged = [t.met for t in targets if t.met is not None]
    return f"{sum(judged)}/{len(judged)}"


def same_schedule(cells: Sequence[Doc], a: str, b: str) -> bool:
    """Policies a and b proposed the same tokens at every step of every request of the cell."""
    ca, cb = (next((c for c in cells if c["policy"] == p), {}) for p in (a, b))
    return bool(ca.get("requests") and cb.get("requests")) and \
        [r.get("sl") for r in ca["requests"]] == [r.get("sl") for r in cb["requests"]]


def grid(doc: Doc, dsde: str = "dsde") -> list[Target]:
    """DSDE with the cap (or `dsde`, e.g. dsde:4) against the best static k and transformers, by mean latency, T=0."""
    who, out = "DSDE+cap" if dsde == "dsde" else dsde, []
    for (w, _, b), cs in groups([c for c in doc["cells"] if c["temperature"] == 0.0], CELL).items():
        d, so, where = get(cs, dsde), get(cs, "static-opt"), cell_name(w, 0.0, b)
        if d and so:
            k = next(c.get("static_opt_k") for c in cs if c["policy"] == "static-opt")
            r = d["mean_e2e_s"] / so["mean_e2e_s"]
            out.append(Target(f"{who} within 5% of the best static k (mean latency)", where, f"{r:.3f}x (k={k})",
                              r <= 1 + WITHIN))
            if w == "mixed":
                out.append(Target(f"{who} ahead of the best static k on mixed (mean latency)", where, f"{r:.3f}x",
                                  r < 1))
        for a in [a for a in ANCHORS if d and get(cs, a)]:
            r = d["mean_e2e_s"] / get(cs, a)["mean_e2e_s"]
            out.append(Target(f"{who} ahead of {a} (mean latency)", where, f"{r:.3f}x", r < 1))
    return out


def cap(doc: Doc) -> list[Target]:
    """DSDE with the cap against DSDE without it, by tokens/s, at the run's largest batch."""
    bmax, out = max((c["batch"] for c in doc["cells"]), default=1), []
    for (w, t, _), cs in groups([c for c in doc["cells"] if c["batch"] == bmax > 1], CELL).items():
        if (d := get(cs, "dsde", TPUT)) and (n := get(cs, "dsde-nocap", TPUT)):
            bound = not same_schedule(cs, "dsde", "dsde-nocap")
            out.append(Target("the cap raises DSDE's tokens/s at the run's largest batch", cell_name(w, t, bmax),
                              f"{d / n:.3f}x" if bound else "never bound", d > n if bound else None))
    return out


def low_acceptance(cells: Sequence[Doc]) -> bool:
    """Where speculation does not pay: DSDE and every static k (there must be one) below target-only."""
    off, d = get(cells, "off", TPUT), get(cells, "dsde", TPUT)
    statics = [c["metrics"][TPUT] for c in cells if c["policy"].startswith("static:")]
    return bool(off and statics and max(statics + [d or 0]) < off)


def _rounds(cells: Sequence[Doc], policy: str) -> str:
    """', ahead in a/n rounds': the rounds (run round-robin) in which dsde-goodput's wall beat `policy`'s."""
    walls = [next((c for c in cells if c["policy"] == p), {}).get("walls_s") or [] for p in (policy, GOODPUT)]
    ahead = sum(x > y for x, y in zip(*walls, strict=False))
    return f", ahead in {ahead}/{len(walls[0])} rounds" if len(walls[0]) == len(walls[1]) >= 2 else ""


def _drafted_nothing(cells: Sequence[Doc]) -> str:
    """Where dsde-goodput's median run ran target-only's steps (its gap is then timing), and the rounds that drafted."""
    if not same_schedule(cells, GOODPUT, "off"):
        return ""
    sl = next(c for c in cells if c["policy"] == GOODPUT).get("sl_means") or []
    drafted = sum(s > 0 for s in sl)
    return f"; median run drafted nothing ({drafted}/{len(sl)} rounds drafted)" if drafted else "; drafted nothing"


def goodput(doc: Doc) -> list[Target]:
    """dsde-goodput by tokens/s: never below target-only where no static k pays, else at least the best static k and
    DSDE+cap (ahead of both on mixed); no collapse from one batch size to the next."""
    out = []
    for (w, t, b), cs in groups(doc["cells"], CELL).items():
        g, off, best, d = get(cs, GOODPUT, TPUT), get(cs, "off", TPUT), best_static(cs), get(cs, "dsde", TPUT)
        if g and off and low_acceptance(cs):
            out.append(Target(LOW, cell_name(w, t, b), f"{g / off:.3f}x{_rounds(cs, 'off')}{_drafted_nothing(cs)}",
                              g / off >= LOW_FLOOR))
        elif g and off and best and d:
            mixed, top = w == "mixed", max(best[1], d)
            out.append(Target(f"dsde-goodput {'ahead of' if mixed else 'at least'} the best static k and DSDE+cap"
                              f"{' on mixed' if mixed else ''} (tokens/s)", cell_name(w, t, b),
                              f"{g / best[1]:.3f}x {best[0]}, {g / d:.3f}x DSDE{_rounds(cs, best[0])}",
                              g > top if mixed else g >= top))
    sizes = sorted({c["batch"] for c in doc["cells"]})
    for (w, t), cs in groups(doc["cells"], ("workload", "temperature")).items() if len(sizes) >= 3 else ():
        by_b = {c["batch"]: c["metrics"]["output_tok_s"] for c in cs if c["policy"] == GOODPUT}
        steps = [(a, b, by_b[b] / by_b[a]) for a, b in zip(sizes, sizes[1:], strict=False) if a in by_b and b in by_b]
        if steps:
            out.append(Target("dsde-goodput's tokens/s drops no more than 10% to a larger batch", f"{w} T={t:g}",
                              ", ".join(f"{a}->{b} {r:.2f}x" for a, b, r in steps),
                              min(r for *_, r in steps) >= 1 - COLLAPSE))
    return out


def simulated(sim: Doc) -> list[Target]:
    """dsde-goodput in the simulator: against Static-opt and DSDE+cap (gpu profile), and where no static k pays."""
    out, floor = [], {}
    for (p, w, b), cs in groups(sim["cells"], ("profile", "workload", "batch")).items():
        s = {c["policy"]: c["metrics"].get("speedup") for c in cs}
        g, so, d, mixed = s.get(GOODPUT), s.get("static-opt"), s.get("dsde"), w == "mixed"
        if p == "gpu" and g and so and d:
            out.append(Target(f"dsde-goodput {'ahead of' if mixed else 'at least'} Static-opt and DSDE+cap"
                              f"{' on mixed' if mixed else ''} (gpu profile)", cell_name(w, None, b),
                              f"{g / max(so, d):.2f}x", g > max(so, d) if mixed else g >= max(so, d)))
        if g and so and so < 1:
            floor.setdefault(p, []).append(g)
    return out + [Target(LOW, p, f"{sum(g >= LOW_FLOOR for g in gs)}/{len(gs)} cells, lowest {min(gs):.2f}x",
                         min(gs) >= LOW_FLOOR) for p, gs in floor.items()]


def validation(docs: dict[str, Doc]) -> list[Target]:
    """The replay's target forwards per output token within 5% of the engine's, run by run (bf16, fp32)."""
    worst = {n: (max(v["rel_error"] for v in rows), d["validation"].get("tolerance", WITHIN))
             for n, d in docs.items() if (rows := (d.get("validation") or {}).get("rows"))}
    return [Target("the replay within 5% of the engine's target forwards per token", n, f"worst {100 * e:.2f}%",
                   e <= tol) for n, (e, tol) in worst.items()]


def _noise(*systems: Doc) -> float:
    """The run's own noise for a ratio of these systems: the largest half-range of their rounds over their median."""
    spreads = [(max(r) - min(r)) / 2 / v["tok_s"] for v in systems if len(r := v.get("tok_s_runs", [])) > 1]
    return max(spreads, default=0.0)


def _at_least(name: str, cell: str, ours: Doc | None, theirs: Sequence[Doc], goal: float) -> list[Target]:
    """ours / the best of theirs >= goal; a miss by less than the run's own noise is reported as within it and met."""
    theirs = [t for t in theirs if t]
    if not ours or not theirs:
        return []
    best = max(theirs, key=lambda t: t["tok_s"])
    ratio, noise = ours["tok_s"] / best["tok_s"], _noise(ours, best)
    within = ratio < goal <= ratio * (1 + noise)
    return [Target(name, cell, f"{ratio:.2f}x" + f" (within the run's noise, {noise:.0%})" * within,
                   ratio >= goal or within)]


def perf(doc: Doc) -> list[Target]:
    """make perf's, per cell: our target-only against llama-server's; the default policy against our target-only and
    against llama-server with its draft (code) or at its best (the other prompts; 4 concurrent requests: with its
    draft and without); transformers as the anchor."""
    out: list[Target] = []
    for cell, s in doc.get("cells", {}).items():
        ours, default = s.get("ours:target-only"), s.get(f"ours:{DEFAULT_POLICY}")
        server, drafts = s.get("llama-server"), [v for n, v in s.items() if n.startswith("llama-server:")]
        out += _at_least("our target-only at least 0.95x llama-server's", cell, ours, [server], PEER_TARGET_ONLY)
        out += _at_least("the default policy never below 0.95x our target-only", cell, default, [ours], 0.95)
        if cell == PERF_BATCH:
            out += _at_least("4 concurrent: the default at least 1.1x llama-server -np 4 with its draft", cell,
                             default, drafts, 1.1)
            out += _at_least("4 concurrent: the default at least llama-server -np 4 without it", cell, default,
                             [server], 1.0)
        elif cell == "code":
            out += _at_least("the default at least llama-server with its draft (its better setting)", cell, default,
                             drafts, 1.0)
        else:
            out += _at_least("the default at least llama-server's best, with or without its draft", cell, default,
                             [server, *drafts], 1.0)
        out += _at_least("our target-only at least transformers generate()", cell, ours,
                         [s.get("transformers:generate")], 1.0)
        out += _at_least("the default at least transformers' assisted generation", cell, default,
                         [s.get("transformers:assisted"), s.get("transformers:assisted-heuristic")], 1.0)
    return out


def service(doc: Doc) -> list[Target]:
    r = doc.get("ratio")
    return [] if r is None else [Target("the service at least 0.9x the in-process engine (tokens/s)",
                                        f"batch {doc.get('batch')}", f"{r:.3f}x", r >= SERVICE_GOAL)]
