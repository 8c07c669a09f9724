"""The `dsde` command: bad input gives a clear error naming the problem; the real pair is lossless in fp32."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

DSDE = [sys.executable, "-m", "dsde_core.cli"]


def _dsde(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([*DSDE, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(("args", "message"), [
    (["generate", "hi", "--policy", "bogus"], "unknown speculation policy"),
    (["generate", "hi", "--policy", "static:-1"], "static"),
    (["generate", "hi", "--draft", "/nonexistent/model"], "/nonexistent/model"),
    (["generate", "hi", "--max-tokens", "0"], "max_tokens"),
    (["generate", "hi", "--temperature", "-1"], "temperature"),
    (["generate", "hi", "--repetition-penalty", "0"], "repetition_penalty"),
    (["generate", "hi", "--dtype", "float8"], "dtype"),
    (["prepare", "no-such-model"], "no-such-model"),
])
def test_bad_input_is_a_clear_error(args: list[str], message: str) -> None:
    res = _dsde(*args, timeout=300)
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith("dsde: error:") and message in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.real_models
def test_generate_compare_is_identical_in_fp32_on_the_real_pair() -> None:
    res = _dsde("generate", "Write a Python function that adds two numbers.", "--chat", "--compare", "--json",
                "--dtype", "float32", "--max-tokens", "24", "--threads", "2")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["identical"] is True
    assert report["token_ids"] == report["target_only"]["token_ids"] and len(report["token_ids"]) > 0
    assert report["text"] == report["target_only"]["text"]
    stats = report["stats"]
    assert stats["drafted"] > 0 and 0 < stats["accepted"] <= stats["drafted"]
    assert stats["target_steps"] < report["target_only"]["stats"]["target_steps"]  # speculation saved steps
    assert report["speedup"] > 0
