"""The engine's speed at batch 1 against target-only and transformers on this machine: a table, and JSON. Not a test.

    .venv/bin/python benchmarks/perf.py [--runs 3] [--max-tokens 128] [--out results/perf.json]

Batch 1, greedy, bf16, the embedded pair (Qwen2.5-Coder 0.5B draft / 1.5B target):
- target-only decoding: our runner against transformers' generate() on the same weights;
- DSDE, dsde-goodput and static k against target-only and against transformers' assisted generation
  (assistant_model=, its default schedule and the "heuristic" one), on a code prompt and a prose prompt;
- batch 8 against batch 1 throughput, target-only and DSDE.
Median of --runs runs per figure; ratios are taken within this one run (the machine is shared and noisy). The
systems of a prompt (and the batch figures) run round-robin, one run of each per round, so a phase of the
machine's speed falls on every system of a round rather than on one system's runs; the machine probe
(dsde_bench.probe) is kept before each round and after the last (`probe_ms`).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from batch_prompts import BATCH_PROMPTS  # benchmarks/batch_prompts.py: the service script sends the same
from transformers import AutoModelForCausalLM

from dsde_bench.probe import PROBE_FORWARDS, machine_probe
from dsde_bench.provenance import code_version, run_meta
from dsde_core.config import EngineConfig, SamplingParams
from dsde_core.llm import SpeculativeLLM
from dsde_core.models.packaged import DRAFT, TARGET, ensure_embedded

PROMPTS = {
    "code": "Write a Python function `merge_intervals(intervals)` that merges overlapping intervals. "
            "Include a docstring, type hints and a few doctest examples.",
    "prose": "Write a short story about a lighthouse keeper who finds a message in a bottle. "
             "Describe the sea, the weather and what the keeper feels.",
}


def _round_robin(systems: dict[str, Callable[[], list[int]]], runs: int, probe: Callable[[], float | None]
                 ) -> tuple[dict[str, list[float]], dict[str, list[int]], list[float | None]]:
    """Each system's tokens/s in each of `runs` rounds, one run of every system a round (after one untimed warm-up
    call each: the first call of each shape pays one-off costs); the last run's tokens; the machine probe's ms before
    each round and after the last."""
    for fn in systems.values():
        fn()
    rates: dict[str, list[float]] = {name: [] for name in systems}
    outs: dict[str, list[int]] = {}
    probes = [probe()]
    for _ in range(runs):
        for name, fn in systems.items():
            t0 = time.perf_counter()
            outs[name] = fn()
            rates[name].append(len(outs[name]) / (time.perf_counter() - t0))
        probes.append(probe())
    return rates, outs, probes


def _prompt_row(name: str, ids: list[int], llm: SpeculativeLLM, params: SamplingParams, hf_gen,
                policies: list[str], assistants: tuple, runs: int, probe: Callable[[], float | None]) -> dict:
    """Every system on one prompt; speedups against our own target-only decoding, measured in this run."""
    def ours(policy: str) -> list[int]:
        return llm.generate([ids], params, policy=policy)[0].token_ids

    systems = {"ours:target-only": lambda: ours("off"),
               **{f"ours:{p}": (lambda p=p: ours(p)) for p in policies if p != "off"}}
    systems["transformers:generate"] = lambda: hf_gen(ids)
    systems["transformers:assisted"] = lambda: hf_gen(ids, assistants[0])
    systems["transformers:assisted-heuristic"] = lambda: hf_gen(ids, assistants[1])
    rates, outs, probes = _round_robin(systems, runs, probe)
    base_ids, base = outs["ours:target-only"], statistics.median(rates["ours:target-only"])
    row: dict = {}
    for sys_name, runs_tok_s in rates.items():
        out, tok_s = outs[sys_name], statistics.median(runs_tok_s)
        k = min(len(out), len(base_ids))
        row[sys_name] = {"tok_s": tok_s, "identical": out[:k] == base_ids[:k], "speedup": tok_s / base,
                         "tok_s_runs": runs_tok_s}
        print(f"{name:6} {sys_name:32} {tok_s:7.2f} {tok_s / base:19.2f}x {row[sys_name]['identical']!s:>15}")
    print(f"{name:6} machine probe ms before each round and after the last: {probes}")
    sys.stdout.flush()
    return {"systems": row, "probe_ms": probes}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--policies", default="off,dsde,static:4,dsde-goodput")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--batch-policies", default="off,dsde", help="policies of the batch-1 against batch-N figures")
    ap.add_argument("--out", default="results/perf.json")
    args = ap.parse_args()
    code = code_version()  # the commit the figures are measured with (BENCHMARKS.md names a run that predates a change)
    torch.set_num_threads(2)
    n = args.max_tokens
    llm = SpeculativeLLM.load(config=EngineConfig(max_batch_size=args.batch, dtype="bfloat16"))
    hf_target = AutoModelForCausalLM.from_pretrained(ensure_embedded(TARGET), dtype=torch.bfloat16).eval()
    hf_draft = AutoModelForCausalLM.from_pretrained(ensure_embedded(DRAFT), dtype=torch.bfloat16).eval()
    heuristic_draft = copy.copy(hf_draft)
    heuristic_draft.generation_config = copy.deepcopy(hf_draft.generation_config)
    heuristic_draft.generation_config.num_assistant_tokens_schedule = "heuristic"
    params = SamplingParams(max_tokens=n)
    llm.generate(["warm up"], SamplingParams(max_tokens=4), policy="static:2")
    results: dict = {"max_tokens": n, "runs": args.runs, "threads": torch.get_num_threads(), "prompts": {},
                     "probe_ms": {}}

    def probe() -> float | None:
        return machine_probe(llm.engine, PROBE_FORWARDS)

    def hf_gen(ids: list[int], assistant=None) -> list[int]:
        x = torch.tensor([ids])
        with torch.inference_mode():
            out = hf_target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                                     assistant_model=assistant, pad_token_id=llm.tokenizer.eos_token_id)
        return out[0, len(ids):].tolist()

    print(f"{'prompt':6} {'system':32} {'tok/s':>7} {'vs ours target-only':>20} {'same as target':>15}")
    for name, text in PROMPTS.items():
        row = _prompt_row(name, llm.encode(text, chat=True), llm, params, hf_gen, args.policies.split(","),
                          (hf_draft, heuristic_draft), args.runs, probe)
        results["prompts"][name], results["probe_ms"][name] = row["systems"], row["probe_ms"]

    batch_ids = [llm.encode(p, chat=True) for p in BATCH_PROMPTS[: args.batch]]
    batch_policies = args.batch_policies.split(",")

    def run(policy: str, bs: int) -> list[int]:
        return [t for o in llm.generate(batch_ids[:bs], params, policy=policy) for t in o.token_ids]

    rates, _, results["probe_ms"]["batch"] = _round_robin(
        {f"{p}@{bs}": (lambda p=p, bs=bs: run(p, bs)) for p in batch_policies for bs in (1, args.batch)},
        max(1, args.runs - 1), probe)
    results["batch"] = {key: statistics.median(r) for key, r in rates.items()}
    for key, r in results["batch"].items():
        print(f"batch {key:12} throughput {r:7.2f} tok/s")
    for policy in batch_policies:
        ratio = results["batch"][f"{policy}@{args.batch}"] / results["batch"][f"{policy}@1"]
        print(f"{policy}: batch {args.batch} / batch 1 throughput = {ratio:.2f}x")
    results["meta"] = run_meta(code)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
