"""Which code a figure was measured with: the commit of a run, and whether the code has changed since (git)."""

from __future__ import annotations

import datetime as dt
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CHECKOUT = Path(__file__).resolve().parent.parent


def _git(*args: str, repo: Path = CHECKOUT) -> subprocess.CompletedProcess[str] | None:
    """A git command in `repo` (this checkout); None where git cannot run."""
    try:
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None


# not code: what a grid of several runs writes as it goes (results/, BENCHMARKS.md), and the docs (*.md)
NOT_CODE = (":!results", ":!*.md")


def code_version(repo: Path = CHECKOUT) -> dict[str, Any] | None:
    """The commit the figures were measured with, and whether code differed from it (NOT_CODE does not count); None
    outside a git checkout."""
    commit = _git("rev-parse", "HEAD", repo=repo)
    changed = _git("status", "--porcelain", "--untracked-files=no", "--", ".", *NOT_CODE, repo=repo)
    if commit is None or changed is None or commit.returncode != 0 or changed.returncode != 0:
        return None
    return {"commit": commit.stdout.strip(), "modified": bool(changed.stdout.strip())}


def changed_since(code: dict[str, Any] | None, repo: Path = CHECKOUT) -> bool:
    """Whether the checkout's code differs from `code` (an earlier code_version()): commits since then that change
    code (NOT_CODE does not count), or uncommitted changes then or now but not both. Outside a git checkout then and
    now: False."""
    now = code_version(repo)
    if code is None or now is None:
        return code != now
    if now["commit"] != code["commit"]:
        diff = _git("diff", "--quiet", code["commit"], now["commit"], "--", ".", *NOT_CODE, repo=repo)
        if diff is None or diff.returncode != 0:  # 1: code changed; 128: a commit this checkout lacks
            return True
    return now["modified"] != code["modified"]


def run_meta(code: dict[str, Any] | None, command: str | None = None, plots: Sequence[str] = ()) -> dict[str, Any]:
    """What a results document records of its run: the command (default: this script's, `python ...`), machine and
    date; `code` is the commit it started with (code_version() then), and whether the checkout differs from that by the
    time it ends (a long run must not be credited to a commit made while it ran)."""
    from dsde_bench.backend import machine_info  # torch: only where a run has just used it

    return {"command": command or "python " + shlex.join(sys.argv), "machine": machine_info(), "code": code,
            "changed_during_run": changed_since(code),
            "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "plots": list(plots)}


# what the engine runs' figures depend on: the engine, dsde_core/ (the policies, the online cost model they plan with,
# and the step loop, workers and model forwards that set every step's time)
FIGURE_CODE = ("dsde_core",)
# A commit whose message carries this trailer changed the code without changing what it measures (a refactor checked
# to give identical figures); its line names the evidence, e.g. "Figures-unchanged: the simulator's 576 cells".
UNCHANGED = "Figures-unchanged:"


def last_change(paths: Sequence[str] = FIGURE_CODE, repo: Path = CHECKOUT) -> tuple[str, str] | None:
    """(commit, date) of the last commit that changed any of `paths`, skipping those marked `UNCHANGED`; None outside
    a git checkout."""
    out = _git("log", "-1", "--format=%H %cs", "--invert-grep", f"--grep=^{UNCHANGED}", "--", *paths, repo=repo)
    if out is None or out.returncode != 0 or not out.stdout.strip():
        return None
    commit, date = out.stdout.split()
    return commit, date


def contains(commit: str | None, change: str) -> bool:
    """Whether the code at `commit` includes commit `change` (False for no commit, or one this checkout lacks)."""
    out = _git("merge-base", "--is-ancestor", change, commit) if commit else None
    return out is not None and out.returncode == 0
