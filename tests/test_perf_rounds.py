"""benchmarks/perf.py's rounds on scripted systems (no models): every system runs once a round after one untimed
warm-up each, interleaved with the others, and the machine probe brackets every round."""

from __future__ import annotations

from tests.bench_scripts import script


def test_systems_run_round_robin_with_a_probe_around_every_round() -> None:
    perf = script("perf")
    calls: list[str] = []

    def system(name: str, n: int):
        def run() -> list[int]:
            calls.append(name)
            return list(range(n))
        return run

    probes = iter([50.0, 60.0, 70.0, 80.0])
    rates, outs, probe_ms = perf._round_robin({"a": system("a", 4), "b": system("b", 2)}, 3, lambda: next(probes))
    assert calls == ["a", "b"] * 4  # one warm-up each, then 3 rounds of one run each, interleaved
    assert probe_ms == [50.0, 60.0, 70.0, 80.0]  # before each round and after the last
    assert [len(r) for r in rates.values()] == [3, 3] and all(x > 0 for r in rates.values() for x in r)
    assert outs == {"a": [0, 1, 2, 3], "b": [0, 1]}
