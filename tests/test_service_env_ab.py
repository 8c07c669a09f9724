"""benchmarks/service_env_ab.py's input: variants parse as named environments, bad ones are CLI errors (no cluster
starts for them)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from tests.bench_scripts import BENCHMARKS, script


@pytest.fixture
def env_ab():  # script() makes its siblings importable while it loads
    return script("service_env_ab")


def test_a_variant_is_a_name_and_its_variables(env_ab) -> None:
    assert env_ab.parse_variant("default=") == ("default", {})
    assert env_ab.parse_variant("spin=GOMP_SPINCOUNT=10000,OMP_WAIT_POLICY=PASSIVE") == (
        "spin", {"GOMP_SPINCOUNT": "10000", "OMP_WAIT_POLICY": "PASSIVE"})
    assert env_ab.parse_variant("eq=A=x=y") == ("eq", {"A": "x=y"})  # a value may hold '='


@pytest.mark.parametrize("text", ["default", "=A=1", "v=A", "v=A=1,=2"])
def test_a_malformed_variant_is_refused(env_ab, text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="expected"):
        env_ab.parse_variant(text)


@pytest.mark.parametrize(("argv", "message"), [
    (["--variant", "a=", "--variant", "a=X=1"], "--variant names must differ"),
    (["--variant", "a=", "--rounds", "0"], "--rounds must be >= 1"),
    (["--variant", "nonsense"], "expected NAME="),
])
def test_bad_arguments_are_a_cli_error_before_any_cluster(argv: list[str], message: str) -> None:
    res = subprocess.run([sys.executable, str(BENCHMARKS / "service_env_ab.py"), *argv], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr, res.stderr
