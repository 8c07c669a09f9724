"""The page's headline: every system against target-only and the best static k, per workload and batch size. Its rows
come from ROW_SOURCES (a results file, and a function from its document to rows of the headline's columns): a peer
engine on the same prompts (e.g. llama.cpp's llama-server) is one more source, its run one more machine line."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from dsde_bench.report.tables import CELL, Doc, Rows, best_static, by_order, cell_name, fmt, groups, pivot

COLUMNS = tuple(cell_name(w, None, b) for w in ("code", "chat", "mixed") for b in (1, 4))


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


# (results file stem, its rows): the T=0 grid's
ROW_SOURCES: tuple[tuple[str, Callable[[Doc], Rows]], ...] = (
    ("bench", lambda doc: policy_rows([c for c in doc["cells"] if c["temperature"] == 0.0])),)


def machine(doc: Doc) -> str:
    """'CPU, N cores, torch X, dtype, date, commit C' of a run."""
    meta = doc.get("meta", {})
    m, code = meta.get("machine") or {}, meta.get("code") or {}
    backend = doc.get("backend") or (doc.get("traces") or [{}])[0].get("backend") or {}  # a simulator run: its traces'
    parts = [m.get("cpu"), m.get("cpu_count") and f"{m['cpu_count']} cores", m.get("torch") and f"torch {m['torch']}",
             backend.get("dtype"), meta.get("created", "")[:10],
             code.get("commit") and f"commit {code['commit'][:7]}" + " with modified code" * bool(code.get("modified"))
             + "; the checkout changed while it ran" * bool(meta.get("changed_during_run"))]
    return ", ".join(p for p in parts if p) or "no record of its machine"


def headline(docs: Mapping[str, Doc]) -> str:
    sources = [name for name, _ in ROW_SOURCES if name in docs]
    rows = {k: v for name, fn in ROW_SOURCES if name in docs for k, v in fn(docs[name]).items()}
    if not rows:
        return "No results yet: run `make bench-grid` (or `dsde bench`), then `python -m dsde_bench report`.\n"
    table = pivot({k: {c: v.get(c, "-") for c in COLUMNS} for k, v in rows.items()}, ["system"])
    return (f"{table}\n\nEach entry: output tokens/s over target-only's / over the best static k's, in the same cell "
            "of the same run at T=0 (the best k picked in hindsight per cell).\n"
            + "".join(f"Machine, `results/{name}.json`: {machine(docs[name])}.\n" for name in sources))
