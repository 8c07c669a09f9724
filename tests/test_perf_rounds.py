"""benchmarks/perf.py's rounds and figures on scripted systems (no models): every system runs all its cells once a
round, the order reversed every other round; a cell's figure is the median round's, against our target-only."""

from __future__ import annotations

from tests.bench_scripts import script


def test_systems_run_once_a_round_in_alternating_order() -> None:
    perf = script("perf")
    calls: list[str] = []
    seconds = iter([1.0, 2.0, 4.0, 1.0, 2.0, 4.0])  # ours: 8 tok/s, then 4, then 2

    def system(name: str, tokens: list[int]):
        def run() -> dict:
            calls.append(name)
            secs = next(seconds) if name == "ours:dsde" else 1.0
            return {"code": ([tokens], secs, {"mean_sl": 1.0 * len(calls)})}
        return run

    runs = perf.rounds({"ours:target-only": system("ours:target-only", [1] * 8),
                        "ours:dsde": system("ours:dsde", [1] * 8),
                        "llama-server": system("llama-server", [1] * 7 + [2])}, 3, ["code"])
    assert calls == ["ours:target-only", "ours:dsde", "llama-server", "llama-server", "ours:dsde",
                     "ours:target-only", "ours:target-only", "ours:dsde", "llama-server"]
    cells = perf.summarise(runs)["code"]
    assert cells["ours:dsde"]["tok_s"] == 4.0 and cells["ours:dsde"]["tok_s_runs"] == [8.0, 4.0, 2.0]
    assert cells["ours:dsde"]["vs_target_only"] == 0.5 and cells["ours:dsde"]["identical"] is True
    assert cells["ours:dsde"]["mean_sl"] == 5.0  # the median round's figures (its second, the fifth call)
    assert cells["llama-server"]["identical"] is False and cells["llama-server"]["vs_target_only"] == 1.0
