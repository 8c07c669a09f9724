"""Which code a run's figures describe (dsde_bench.provenance): its commit, whether the code changed since, and the
engine's last change."""

from __future__ import annotations

import subprocess
from pathlib import Path

from dsde_bench import provenance


def _git(repo: Path, *args: str) -> str:
    """A git command in a scratch repository (its own author): its stdout."""
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()


def _write(repo: Path, path: str, text: str) -> None:
    (repo / path).parent.mkdir(parents=True, exist_ok=True)
    (repo / path).write_text(text)


def test_a_commit_this_checkout_lacks_or_none_contains_no_change() -> None:
    commit, _ = provenance.last_change()  # this checkout's history (CI clones it too)
    assert provenance.contains(commit, commit) and provenance.contains(provenance.code_version()["commit"], commit)
    assert not provenance.contains(None, commit) and not provenance.contains("0" * 40, commit)


def test_a_commit_marked_figures_unchanged_is_not_a_change_to_the_engine(tmp_path: Path) -> None:
    """A change anywhere under dsde_core/ counts (a model's forward sets every step's time as much as a policy sets its
    plan); the benchmark's own code and the docs do not. A refactor checked to give identical figures says so in a
    trailer; the runs before it stay current."""
    def git(*args: str) -> str:
        return _git(tmp_path, *args)

    def commit(text: str, message: str, path: str = "dsde_core/policies/p.py") -> str:
        _write(tmp_path, path, text)
        git("add", ".")
        git("commit", "-q", "-m", message)
        return git("rev-parse", "HEAD")

    git("init", "-q")
    first = commit("a = 1\n", "the policy")
    assert provenance.last_change(repo=tmp_path)[0] == first
    commit("a = 1  # folded\n", f"fold a helper\n\n{provenance.UNCHANGED} the simulator's cells are identical")
    assert provenance.last_change(repo=tmp_path)[0] == first
    second = commit("a = 2\n", f"a new rule; the old one said {provenance.UNCHANGED} in its body text")
    assert provenance.last_change(repo=tmp_path)[0] == second  # only a trailer line marks it
    third = commit("b = 1\n", "the cost model the policy plans with", "dsde_core/cost.py")
    assert provenance.last_change(repo=tmp_path)[0] == third
    fourth = commit("c = 1\n", "a faster attention: every step's time changes", "dsde_core/models/llama.py")
    assert provenance.last_change(repo=tmp_path)[0] == fourth
    commit("d = 1\n", "the docs", "README.md")
    commit("e = 1\n", "the benchmark's report", "dsde_bench/report/sections.py")
    assert provenance.last_change(repo=tmp_path)[0] == fourth


def test_a_scripts_run_records_its_command_machine_and_commit() -> None:
    """benchmarks/perf.py and the service script call run_meta(code) as `dsde bench` does, so the page can tell
    which code their figures describe."""
    code = provenance.code_version()
    meta = provenance.run_meta(code)
    assert meta["command"].startswith("python ") and meta["code"] == code and not meta["changed_during_run"]
    assert meta["machine"]["cpu_count"] >= 1 and meta["created"][:2] == "20"
    assert provenance.run_meta(None, "dsde bench --x", ["p.png"])["command"] == "dsde bench --x"
    assert provenance.run_meta({"commit": "0" * 40, "modified": False})["changed_during_run"]


def test_docs_are_not_code_to_a_runs_provenance(tmp_path: Path) -> None:
    """A run's meta says "modified" or "changed during the run" only for code: an uncommitted or newly committed
    README (any *.md) or results file does not count; a source file does, and so does a commit the checkout lacks."""
    def git(*args: str) -> str:
        return _git(tmp_path, *args)

    def write(path: str, text: str) -> None:
        _write(tmp_path, path, text)

    git("init", "-q")
    for path in ("README.md", "dsde_bench/runner.py", "results/bench.json"):
        write(path, "1\n")
    git("add", ".")
    git("commit", "-q", "-m", "start")
    start = provenance.code_version(tmp_path)
    assert start is not None and start["modified"] is False
    write("README.md", "2\n")
    write("results/bench.json", "2\n")
    assert provenance.code_version(tmp_path)["modified"] is False  # docs and results: not code
    assert not provenance.changed_since(start, tmp_path)
    git("commit", "-q", "-am", "docs and results")
    assert not provenance.changed_since(start, tmp_path)  # a new commit, but no code in it
    write("dsde_bench/runner.py", "2\n")
    assert provenance.code_version(tmp_path)["modified"] is True and provenance.changed_since(start, tmp_path)
    git("commit", "-q", "-am", "the runner")
    assert provenance.changed_since(start, tmp_path)  # committed since the run started
    assert provenance.changed_since({"commit": "0" * 40, "modified": False}, tmp_path)  # a commit it lacks
    assert not provenance.changed_since(None, tmp_path / "nowhere") and provenance.changed_since(None, tmp_path)
