"""The page's headline: a table per row source, each a results file and a function from its document to rows of its
own columns, with what an entry means and the run's machine under it. First `make perf`'s (our engine on its default
backend against llama.cpp's own server and transformers, same prompts and GGUF files), then the T=0 grid's (every
policy against target-only and the best static k, per workload and batch size). A peer engine measured on the same
prompts is one more source."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from dsde_bench.report.tables import CELL, Doc, Rows, best_static, by_order, cell_name, fmt, groups, pivot
from dsde_core.models.backends import BACKENDS

GRID_COLUMNS = tuple(cell_name(w, None, b) for w in ("code", "chat", "mixed") for b in (1, 4))
PERF_COLUMNS = {"code": "code b1", "prose": "prose b1", "summ": "summ b1", "chat x4": "chat x4 concurrent"}


def policy_rows(cells: list[Doc], with_t: bool = False) -> Rows:
    """A row per system (the static k's as 'best static k'): tokens/s over target-only's / over the best static k's."""
    names = {c["policy"]: c.get("label", c["policy"]) for c in by_order(cells)}
    rows: Rows = {}
    for (w, t, b), cs in groups(cells, CELL).items():
        col, tput = cell_name(w, t, b, with_t), {c["policy"]: c["metrics"]["output_tok_s"] for c in cs}
        off, best = tput.get("off"), best_static(cs)
        if off:
            rows.setdefault("target-only, tok/s", {})[col] = fmt(off, ".1f")
        if off and best:
            rows.setdefault("best static k", {})[col] = f"{best[1] / off:.2f} (k={best[0].removeprefix('static:')})"
        for p in [p for p in names if p in tput and p != "off" and not p.startswith("static")]:
            vs_best = f" / {tput[p] / best[1]:.2f}" if best else ""
            rows.setdefault(names[p], {})[col] = f"{fmt(tput[p] / off if off else None)}{vs_best}"
    return rows


def perf_rows(doc: Doc) -> Rows:
    """A row per system of make perf: tokens/s, and over llama-server's target-only tokens/s in the same cell."""
    rows: Rows = {}
    for cell, systems in doc.get("cells", {}).items():
        peer = (systems.get("llama-server") or {}).get("tok_s")
        for name, v in systems.items():
            ratio = f" ({v['tok_s'] / peer:.2f}x)" if peer else ""
            rows.setdefault(name, {})[PERF_COLUMNS.get(cell, cell)] = f"{fmt(v['tok_s'], '.1f')}{ratio}"
    return rows


@dataclass(frozen=True)
class Source:
    name: str  # the results file's stem
    rows: Callable[[Doc], Rows]
    columns: Sequence[str]
    meaning: str  # what an entry is


ROW_SOURCES: tuple[Source, ...] = (
    Source("perf", perf_rows, tuple(PERF_COLUMNS.values()),
           "Each entry: output tokens/s end to end, greedy, 128 tokens a request (and over llama-server's target-only "
           "tokens/s in the same cell of the same run). Ours: the in-process engine on its default backend "
           "(llama.cpp on the CPU); `ours:target-only` is policy `off`, `ours:dsde-goodput` the default policy."),
    Source("bench", lambda doc: policy_rows([c for c in doc["cells"] if c["temperature"] == 0.0]), GRID_COLUMNS,
           "Each entry: output tokens/s over target-only's / over the best static k's, in the same cell of the same "
           "run at T=0 (the best k picked in hindsight per cell)."),
)


def machine(doc: Doc) -> str:
    """'CPU, N cores, torch X, dtype, date, commit C' of a run."""
    meta = doc.get("meta", {})
    m, code = meta.get("machine") or {}, meta.get("code") or {}
    backend = doc.get("backend") or (doc.get("traces") or [{}])[0].get("backend") or {}  # a simulator run: its traces'
    # the target's runner: a grid's "backend", or make perf's "target"; a run recorded before runners had names: torch
    runner = backend.get("backend") or (backend.get("target") if backend.get("target") in BACKENDS else None)
    parts = [m.get("cpu"), m.get("cpu_flags"), m.get("cpu_count") and f"{m['cpu_count']} cores",
             m.get("torch") and f"torch {m['torch']}", runner and f"{runner} backend", backend.get("dtype"),
             meta.get("created", "")[:10],
             code.get("commit") and f"commit {code['commit'][:7]}" + " with modified code" * bool(code.get("modified"))
             + "; the checkout changed while it ran" * bool(meta.get("changed_during_run"))]
    return ", ".join(p for p in parts if p) or "no record of its machine"


def headline(docs: Mapping[str, Doc]) -> str:
    tables = []
    for src in (s for s in ROW_SOURCES if s.name in docs):
        rows = src.rows(docs[src.name])
        if rows:
            table = pivot({k: {c: v.get(c, "-") for c in src.columns} for k, v in rows.items()}, ["system"])
            tables.append(f"{table}\n\n{src.meaning}\nMachine, `results/{src.name}.json`: {machine(docs[src.name])}.\n")
    if not tables:
        return "No results yet: run `make perf` or `make bench-grid`, then `python -m dsde_bench report`.\n"
    return "\n".join(tables)
