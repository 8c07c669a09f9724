"""Reading results documents and writing Markdown tables: the pieces every section of the report is made of."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dsde_core.errors import ConfigError

Doc = dict[str, Any]


class ResultsError(ConfigError):
    """A results file the report cannot read: named, so that a section never goes missing without a word."""


def load(path: Path) -> Doc | None:
    """A results document (a JSON object); None where the file does not exist, a ResultsError naming it otherwise."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as e:
        raise ResultsError(f"{path}: not a JSON document ({e}); a script's --json FILE writes one") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ResultsError(f"{path}: cannot be read ({e})") from None
    if not isinstance(doc, dict):
        raise ResultsError(f"{path}: a JSON {type(doc).__name__}, not a results document (an object)")
    return doc


def fmt(x: Any, spec: str = ".2f") -> str:
    if x is None or (isinstance(x, float) and (math.isnan(x) or math.isinf(x))):
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    return format(x, spec) if isinstance(x, (int, float)) else str(x)


def md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(out + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


Rows = dict[Any, dict[str, str]]  # row name (or a tuple of names) -> column -> entry


def has_cells(doc: Doc) -> bool:
    """Whether a run holds a list of measured cells, which results/<run>.md lists one by one (make perf's cells are
    a dict by prompt, all on BENCHMARKS.md)."""
    return isinstance(doc.get("cells"), list) and bool(doc["cells"])


def pivot(rows: Rows, header: Sequence[str], last: Sequence[str] = ()) -> str:
    """Rows of named entries as one table: every column a row has, in first-seen order (`last` at the end), and '-'
    where a row has none."""
    cols = [c for c in dict.fromkeys(c for r in rows.values() for c in r) if c not in last] + list(last)
    return md_table([*header, *cols], [[*(k if isinstance(k, tuple) else (k,)), *(r.get(c, "-") for c in cols)]
                                       for k, r in rows.items()])


def groups(cells: Sequence[Doc], keys: Sequence[str]) -> dict[tuple, list[Doc]]:
    out: dict[tuple, list[Doc]] = {}
    for c in cells:
        out.setdefault(tuple(c.get(k) for k in keys), []).append(c)
    return out


CELL = ("workload", "temperature", "batch")


def cell_name(w: str, t: float | None, b: int, with_t: bool = True) -> str:
    """'chat T=1 b4' ('chat b4' without the temperature)."""
    return f"{w} T={t:g} b{b}" if with_t and t is not None else f"{w} b{b}"


def get(cells: Sequence[Doc], policy: str, key: str | None = None) -> Any:
    """The metrics of `policy`'s cell among `cells` (or its figure `key`), None where there is none."""
    return next(((c["metrics"].get(key) if key else c["metrics"]) for c in cells if c["policy"] == policy), None)


def best_static(cells: Sequence[Doc]) -> tuple[str, float] | None:
    """(policy, tokens/s) of the static k with the highest tokens/s."""
    return max([(c["policy"], c["metrics"]["output_tok_s"]) for c in cells if c["policy"].startswith("static:")],
               key=lambda s: s[1], default=None)


ORDER = ("off", "static", "static-opt", "heuristic", "adaedl", "acceptance", "dsde-nocap", "dsde", "dsde-paper",
         "dsde-goodput", "hf-assisted", "hf-assisted-heuristic", "hf-generate", "oracle")


def by_order(cells: Sequence[Doc]) -> list[Doc]:
    """Target-only, the static k's by k, then the adaptive policies and transformers' systems; others before those."""
    def key(p: str) -> tuple[int, int]:
        name, _, k = p.partition(":")
        return (ORDER.index(name) if name in ORDER else 9), int(k) if k.isdigit() else 0
    return sorted(cells, key=lambda c: key(c["policy"]))
