"""The `dsde` command: bad input gives a clear error naming the problem; the real pair is lossless in fp32."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest

from tests.cli_support import help_flags

DSDE = [sys.executable, "-m", "dsde_cli.main"]


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
    (["generate", "hi", "--device", "cuda:99"], "device 'cuda:99': "),  # no CUDA here, or fewer GPUs: before loading
    (["generate", "word " * 2100, "--max-tokens", "4"], "+ --max-tokens (4) = "),  # the user's, not the warm-up's
    (["prepare", "no-such-model"], "no-such-model"),
])
def test_bad_input_is_a_clear_error(args: list[str], message: str) -> None:
    res = _dsde(*args, timeout=300)
    assert res.returncode == 2, res.stderr
    last = res.stderr.strip().splitlines()[-1]  # after any warnings of the libraries that loaded the models
    assert last.startswith("dsde: error:") and message in last, res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.real_models
def test_generate_compare_is_identical_in_fp32_on_the_real_pair() -> None:
    res = _dsde("generate", "Write a Python function that adds two numbers.", "--chat", "--compare", "--json",
                "--dtype", "float32", "--max-tokens", "24", "--threads", "2")
    assert res.returncode == 0, res.stderr
    assert "Loading weights" not in res.stderr  # transformers' progress bars are off: the command reports its own
    report = json.loads(res.stdout)
    assert report["identical"] is True
    assert report["token_ids"] == report["target_only"]["token_ids"] and len(report["token_ids"]) > 0
    assert report["text"] == report["target_only"]["text"]
    stats = report["stats"]
    assert stats["drafted"] > 0 and 0 < stats["accepted"] <= stats["drafted"]
    assert stats["target_steps"] < report["target_only"]["stats"]["target_steps"]  # speculation saved steps
    assert report["speedup"] > 0


def test_every_generate_flag_reaches_the_sampling_the_engine_or_the_output(monkeypatch, capsys) -> None:
    """Each of `dsde generate`'s flags, given a value other than its default, reaches what it names (a fake LLM
    records what the command asks of it; the real pair is the test above). A new flag fails this until listed."""
    from dsde_cli import generate as cli
    from dsde_cli import main as dsde_main
    from dsde_core.llm import GenerationResult
    from dsde_core.request import RequestStats

    calls: dict = {"generate": []}

    class FakeLLM:
        @classmethod
        def load(cls, **kw):
            calls["load"] = kw
            return cls()

        def encode(self, prompt, chat=False):
            calls["encode"] = (prompt, chat)
            return [5, 6]

        @property
        def engine(self):
            return types.SimpleNamespace(validate=lambda *args: calls.update(validated=args))

        def generate(self, prompts, params, policy):
            calls["generate"].append((prompts, params, policy))
            return [GenerationResult("out", [1, 2], 3, "length", RequestStats(steps=2))]

    monkeypatch.setattr(cli, "SpeculativeLLM", FakeLLM)
    given = {"--policy": "static:3", "--max-tokens": "7", "--temperature": "0.5", "--top-p": "0.9", "--top-k": "5",
             "--seed": "11", "--presence-penalty": "0.25", "--frequency-penalty": "0.5", "--repetition-penalty": "1.1",
             "--dtype": "float32", "--device": "cpu", "--threads": "1", "--draft": "d", "--target": "t",
             "--backend": "torch", "--draft-backend": "llama.cpp", "--step": "static"}
    switches = ["--chat", "--compare", "--json"]
    flags = help_flags(dsde_main.parser(), "generate")
    assert flags == set(given) | set(switches), flags ^ (set(given) | set(switches))
    assert dsde_main.main(["generate", "hi", *[x for kv in given.items() for x in kv], *switches]) == 0
    load = calls["load"]
    assert (load["draft"], load["target"]) == ("d", "t")
    assert (load["config"].dtype, load["config"].device, load["config"].num_threads) == ("float32", "cpu", 1)
    assert (load["config"].backend, load["config"].draft_backend) == ("torch", "llama.cpp")
    assert load["config"].step == "static"
    _warm, (prompts, params, policy), (_, base_params, base_policy) = calls["generate"]  # --compare: off too
    assert calls["encode"] == ("hi", True) and prompts == [[5, 6]] and policy == "static:3" and base_policy == "off"
    assert base_params == params and calls["validated"] == ([5, 6], params, "--max-tokens")
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.seed) == (7, 0.5, 0.9, 5, 11)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.25, 0.5, 1.1)
    report = json.loads(capsys.readouterr().out)  # --json
    assert report["policy"] == "static:3" and report["identical"] is True and report["target_only"]["text"] == "out"


def test_a_command_ends_in_a_status_never_a_traceback(capsys) -> None:
    """The `dsde` command runs its handlers through run_command: a DSDEError is one line on stderr and status 2,
    Ctrl-C (KeyboardInterrupt) status 130, otherwise the handler's own status."""
    from dsde_cli import main as dsde_main
    from dsde_core.errors import ConfigError

    def fails(args) -> int:
        raise ConfigError("max_tokens must be >= 1")

    def interrupted(args) -> int:
        raise KeyboardInterrupt

    assert dsde_main.run_command(fails, None) == 2
    assert capsys.readouterr().err == "dsde: error: max_tokens must be >= 1\n"
    assert dsde_main.run_command(interrupted, None) == 130
    assert dsde_main.run_command(lambda args: 7, None) == 7
    # the `dsde` command's handlers go through it
    assert dsde_main.main(["generate", "hi", "--max-tokens", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dsde: error:") and "max_tokens" in err and "Traceback" not in err


def test_version_is_one_number_everywhere(capsys) -> None:
    """`dsde --version` (and the service's GET /version) say dsde_core's version, which is the package's
    (pyproject.toml) and the Helm chart's appVersion."""
    import tomllib
    from pathlib import Path

    import yaml

    import dsde_core
    from dsde_cli import main as dsde_main

    root = Path(__file__).resolve().parents[1]
    with pytest.raises(SystemExit) as done:
        dsde_main.main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == f"dsde {dsde_core.__version__}\n"
    assert tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"] == dsde_core.__version__
    assert yaml.safe_load((root / "helm/dsde/Chart.yaml").read_text())["appVersion"] == dsde_core.__version__
