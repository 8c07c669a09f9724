"""PNG figures from the results documents (matplotlib, Agg backend). Each function returns the paths it wrote.

- speedup by policy and workload (one panel per batch size, per temperature)
- output throughput against batch size (one panel per workload)
- SL over time beside the KLD and WVIR, for a few DSDE sequences
- simulator: target forwards per token against the oracle, and speedup under each cost profile
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

POLICY_ORDER = ("static-opt", "heuristic", "adaedl", "acceptance", "dsde-nocap", "dsde", "dsde-paper", "dsde-goodput",
                "hf-assisted", "hf-assisted-heuristic", "hf-generate", "oracle")


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _ok(x: Any) -> bool:
    return isinstance(x, (int, float)) and not math.isnan(x)


def _policies(cells: Sequence[dict[str, Any]], with_static: bool = False) -> list[str]:
    present = {c["policy"] for c in cells}
    out = [p for p in POLICY_ORDER if p in present]
    if with_static:
        out = sorted((p for p in present if p.startswith("static:")), key=lambda p: int(p.split(":")[1])) + out
    return out


def _color(j: int, pol: str) -> Any:
    import matplotlib

    return "black" if pol == "oracle" else matplotlib.colormaps["tab20"](j % 20)


def _bars(ax: Any, cells: list[dict[str, Any]], workloads: list[str], policies: list[str], key: str) -> None:
    width = 0.8 / max(1, len(policies))
    for j, pol in enumerate(policies):
        ys = []
        for w in workloads:
            c = next((c for c in cells if c["workload"] == w and c["policy"] == pol), None)
            v = c["metrics"].get(key) if c else None
            ys.append(v if _ok(v) else 0.0)
        xs = [i + (j - (len(policies) - 1) / 2) * width for i in range(len(workloads))]
        ax.bar(xs, ys, width, label=pol, color=_color(j, pol))
    ax.set_xticks(range(len(workloads)), workloads)
    ax.axhline(1.0, color="black", lw=0.8, ls="--")


def _legend(fig: Any, axes: Sequence[Any]) -> None:
    """One legend for the figure with every label of every panel (panels may show different policies)."""
    seen: dict[str, Any] = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            seen.setdefault(lab, h)
    fig.legend(list(seen.values()), list(seen), fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))


def speedup_plots(doc: dict[str, Any], out_dir: Path) -> list[Path]:
    plt = _plt()
    cells = doc["cells"]
    paths = []
    for temp in sorted({c["temperature"] for c in cells}):
        tc = [c for c in cells if c["temperature"] == temp]
        batches = sorted({c["batch"] for c in tc})
        workloads = list(dict.fromkeys(c["workload"] for c in tc))
        fig, axes = plt.subplots(1, len(batches), figsize=(5 + 2.2 * len(workloads) * len(batches), 4.2),
                                 squeeze=False)
        for ax, bs in zip(axes[0], batches, strict=True):
            bc = [c for c in tc if c["batch"] == bs]
            _bars(ax, bc, workloads, _policies(bc), "speedup")
            ax.set_title(f"batch {bs}, T={temp:g}")
            ax.set_ylabel("mean latency speedup over target-only")
        _legend(fig, axes[0])
        fig.tight_layout()
        p = out_dir / f"speedup_T{temp:g}.png"
        fig.savefig(p, dpi=110, bbox_inches="tight")
        plt.close(fig)
        paths.append(p)
    return paths


def throughput_plot(doc: dict[str, Any], out_dir: Path, temperature: float = 0.0) -> list[Path]:
    plt = _plt()
    cells = [c for c in doc["cells"] if c["temperature"] == temperature and c.get("kind", "engine") == "engine"]
    workloads = list(dict.fromkeys(c["workload"] for c in cells))
    if not workloads or len({c["batch"] for c in cells}) < 2:
        return []
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.5 * len(workloads), 4), squeeze=False)
    for ax, w in zip(axes[0], workloads, strict=True):
        wc = [c for c in cells if c["workload"] == w]
        for pol in ["off", *_policies(wc)]:
            pts = sorted((c["batch"], c["metrics"]["output_tok_s"]) for c in wc if c["policy"] == pol)
            if pts:
                ax.plot([b for b, _ in pts], [t for _, t in pts], marker="o", label=pol)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"{w}, T={temperature:g}")
    _legend(fig, axes[0])
    fig.tight_layout()
    p = out_dir / f"throughput_T{temperature:g}.png"
    fig.savefig(p, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return [p]


def sl_series_plot(series: Sequence[dict[str, Any]], out_dir: Path, policy: str = "dsde", limit: int = 3,
                   name: str = "sl_kld_wvir.png") -> list[Path]:
    """For up to `limit` sequences of `policy`: SL (planned, accepted, DSDE's SL_hat and cap), the step's mean
    KLD, and WVIR, against the step index."""
    picked = [s for s in series if s["policy"] == policy and len(s["steps"]) > 1][:limit]
    if not picked:
        return []
    plt = _plt()
    fig, axes = plt.subplots(3, len(picked), figsize=(4.8 * len(picked), 7.5), squeeze=False, sharex="col")
    for j, s in enumerate(picked):
        rows = s["steps"]
        x = list(range(len(rows)))
        ax = axes[0][j]
        ax.step(x, [r["planned"] for r in rows], where="mid", label="k planned")
        ax.plot(x, [r["accepted"] for r in rows], "o", ms=3, label="accepted")
        if any("sl_hat" in r for r in rows):
            ax.plot(x, [r.get("sl_hat", math.nan) for r in rows], "--", label="SL_hat (next)")
        if any("cap" in r for r in rows):
            ax.plot(x, [r.get("cap", math.nan) for r in rows], ":", label="cap")
        ax.set_title(f"{s['workload']} b={s['batch']} {s['request']}"[:48], fontsize=9)
        ax.set_ylabel("tokens")
        axes[1][j].plot(x, [r.get("kld_mean", math.nan) for r in rows], color="tab:red")
        axes[1][j].set_ylabel("mean KLD of the step")
        axes[2][j].plot(x, [r.get("wvir", math.nan) for r in rows], color="tab:purple")
        axes[2][j].axhline(1.0, color="black", lw=0.6, ls="--")
        axes[2][j].set_ylabel("WVIR")
        axes[2][j].set_xlabel("step")
    _legend(fig, [axes[0][j] for j in range(len(picked))])
    fig.tight_layout()
    p = out_dir / name
    fig.savefig(p, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return [p]


def sim_plots(doc: dict[str, Any], out_dir: Path) -> list[Path]:
    plt = _plt()
    cells = doc["cells"]
    paths = []
    profiles = list(dict.fromkeys(c["profile"] for c in cells))
    batch = min(c["batch"] for c in cells)
    base = [c for c in cells if c["profile"] == profiles[0] and c["batch"] == batch and c["policy"] != "static-opt"]
    workloads = list(dict.fromkeys(c["workload"] for c in base))
    pols = [p for p in _policies(base, with_static=True) if p != "off"]
    fig, ax = plt.subplots(figsize=(4 + 1.6 * len(workloads) * max(1, len(pols)) / 4, 4.2))
    _bars(ax, base, workloads, pols, "target_fwd_per_tok")
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_ylabel("target forwards per output token (lower is better)")
    ax.set_title(f"simulated, batch {batch}: distance to the oracle")
    _legend(fig, [ax])
    fig.tight_layout()
    p = out_dir / "sim_oracle.png"
    fig.savefig(p, dpi=110, bbox_inches="tight")
    plt.close(fig)
    paths.append(p)
    batches = sorted({c["batch"] for c in cells})
    fig, axes = plt.subplots(len(profiles), len(batches), figsize=(4.6 * len(batches), 3.6 * len(profiles)),
                             squeeze=False)
    for i, prof in enumerate(profiles):
        for j, bs in enumerate(batches):
            bc = [c for c in cells if c["profile"] == prof and c["batch"] == bs]
            _bars(axes[i][j], bc, workloads, _policies(bc), "speedup")
            axes[i][j].set_title(f"{prof}, batch {bs}", fontsize=9)
    _legend(fig, [ax for row in axes for ax in row])
    fig.tight_layout()
    p = out_dir / "sim_speedup.png"
    fig.savefig(p, dpi=110, bbox_inches="tight")
    plt.close(fig)
    paths.append(p)
    return paths


def bench_plots(doc: dict[str, Any], out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = speedup_plots(doc, out)
    for t in sorted({c["temperature"] for c in doc["cells"]}):
        paths += throughput_plot(doc, out, t)
    paths += sl_series_plot(doc.get("series", []), out)
    return paths


def simulate_plots(doc: dict[str, Any], out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return sim_plots(doc, out) + sl_series_plot(doc.get("series", []), out, name="sim_sl_kld_wvir.png")
