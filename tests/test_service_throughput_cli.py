"""benchmarks/service_throughput.py's input: `--companies` parses as distinct known names, bad arguments are CLI
errors (no model loads and no cluster starts for them)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from tests.bench_scripts import BENCHMARKS, script


@pytest.fixture
def throughput():  # script() makes its siblings importable while it loads
    return script("service_throughput")


def test_companies_are_distinct_known_names_in_order(throughput) -> None:
    assert throughput._companies("none, app,pair") == ["none", "app", "pair"]
    assert throughput._companies("memory") == ["memory"]


@pytest.mark.parametrize("text", ["", ",", "none,none", "none,gpu"])
def test_bad_companies_are_refused(throughput, text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="distinct names from none, serve, pair, memory, ticker, app"):
        throughput._companies(text)


@pytest.mark.parametrize(("argv", "message"), [
    (["--beside", "--companies", "none,swap"], "argument --companies: a comma-separated list"),
    (["--beside", "--rounds", "0"], "--rounds must be >= 1"),
    (["--step-split", "--rounds", "0"], "--rounds must be >= 1"),
])
def test_bad_arguments_are_a_cli_error_before_any_model_loads(argv: list[str], message: str) -> None:
    res = subprocess.run([sys.executable, str(BENCHMARKS / "service_throughput.py"), *argv], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_a_runs_outputs_are_counted_against_the_first_runs(throughput) -> None:
    assert throughput.identical(["a", "b"], ["a", "c"]) == "1 of 2 outputs as the first run's"
    with pytest.raises(ValueError):  # runs of different prompt counts are never compared
        throughput.identical(["a"], ["a", "b"])
