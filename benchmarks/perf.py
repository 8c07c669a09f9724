"""Performance figures of issue 2 on this machine: prints a table, writes JSON. Not a test.

    .venv/bin/python benchmarks/perf.py [--runs 3] [--max-tokens 128] [--out results/perf.json]

Batch 1, greedy, bf16, the embedded pair (Qwen2.5-Coder 0.5B draft / 1.5B target):
- target-only decoding: our runner against transformers' generate() on the same weights;
- DSDE, dsde-goodput and static k against target-only and against transformers' assisted generation
  (assistant_model=, its default schedule and the "heuristic" one), on a code prompt and a prose prompt;
- batch 8 against batch 1 throughput, target-only and DSDE.
Median of --runs runs per figure; ratios are taken within this one run (the machine is shared and noisy).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

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
BATCH_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a hash map is and when to use one.",
    "Write a Python class for a stack with push, pop and peek.",
    "Describe the water cycle in a few paragraphs.",
    "Write a function that returns the n-th prime number in Python.",
    "What are the advantages of unit tests? Answer in prose.",
    "Write a SQL query that finds the top 5 customers by total order value.",
    "Write a bash script that counts lines in every .py file of a folder.",
]


def _median_rate(fn, runs: int) -> tuple[float, list[int]]:
    rates, ids = [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        ids = fn()
        rates.append(len(ids) / (time.perf_counter() - t0))
    return statistics.median(rates), ids


def _prompt_row(name: str, ids: list[int], llm: SpeculativeLLM, params: SamplingParams, hf_gen,
                policies: list[str], assistants: tuple, runs: int) -> dict:
    """Every system on one prompt; speedups against our own target-only decoding, measured in this run."""
    row: dict = {}
    rate, base_ids = _median_rate(lambda: llm.generate([ids], params, policy="off")[0].token_ids, runs)
    row["ours:target-only"] = {"tok_s": rate, "identical": True}
    systems = {f"ours:{p}": (lambda p=p: llm.generate([ids], params, policy=p)[0].token_ids)
               for p in policies if p != "off"}
    systems["transformers:generate"] = lambda: hf_gen(ids)
    systems["transformers:assisted"] = lambda: hf_gen(ids, assistants[0])
    systems["transformers:assisted-heuristic"] = lambda: hf_gen(ids, assistants[1])
    for sys_name, fn in systems.items():
        fn()  # warm-up: the first call of each shape pays one-off costs
        r, out = _median_rate(fn, runs)
        k = min(len(out), len(base_ids))
        row[sys_name] = {"tok_s": r, "identical": out[:k] == base_ids[:k]}
    for sys_name, v in row.items():
        v["speedup"] = v["tok_s"] / rate
        print(f"{name:6} {sys_name:32} {v['tok_s']:7.2f} {v['speedup']:19.2f}x {v['identical']!s:>15}")
        sys.stdout.flush()
    return row


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
    results: dict = {"max_tokens": n, "runs": args.runs, "threads": torch.get_num_threads(), "prompts": {}}

    def hf_gen(ids: list[int], assistant=None) -> list[int]:
        x = torch.tensor([ids])
        with torch.inference_mode():
            out = hf_target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                                     assistant_model=assistant, pad_token_id=llm.tokenizer.eos_token_id)
        return out[0, len(ids):].tolist()

    print(f"{'prompt':6} {'system':32} {'tok/s':>7} {'vs ours target-only':>20} {'same as target':>15}")
    for name, text in PROMPTS.items():
        results["prompts"][name] = _prompt_row(name, llm.encode(text, chat=True), llm, params, hf_gen,
                                               args.policies.split(","), (hf_draft, heuristic_draft), args.runs)

    results["batch"] = {}
    batch_ids = [llm.encode(p, chat=True) for p in BATCH_PROMPTS[: args.batch]]
    batch_policies = args.batch_policies.split(",")
    for policy in batch_policies:
        for bs in (1, args.batch):
            def run(policy=policy, bs=bs) -> list[int]:
                outs = llm.generate(batch_ids[:bs], params, policy=policy)
                return [t for o in outs for t in o.token_ids]
            r, _ = _median_rate(run, max(1, args.runs - 1))
            results["batch"][f"{policy}@{bs}"] = r
            print(f"batch {bs:2} {policy:6} throughput {r:7.2f} tok/s")
            sys.stdout.flush()
    for policy in batch_policies:
        ratio = results["batch"][f"{policy}@{args.batch}"] / results["batch"][f"{policy}@1"]
        print(f"{policy}: batch {args.batch} / batch 1 throughput = {ratio:.2f}x")
    results["meta"] = run_meta(code)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
