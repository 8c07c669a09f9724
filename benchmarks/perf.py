"""The engine against its peers on this CPU, on the same prompts and GGUF files: a table, and JSON. Not a test.

    .venv/bin/python benchmarks/perf.py [--runs 3] [--max-tokens 128] [--out results/perf.json]
                                        [--policies off,dsde-goodput,dsde,static:3] [--no-peer] [--no-anchor]

Systems, greedy, each generating --max-tokens past any end of text (the same work for all):
- ours: the in-process engine on the llama.cpp backend (the embedded Q4_K_M files), one row per policy; each policy
  object is kept across its runs and first serves every prompt once, untimed (a server's steady state);
- llama-server (dsde_bench.llama_server): llama.cpp's own server, built from the same source, on the same files,
  given the same prompt token ids over HTTP: target-only, with the draft at its default settings, and with
  `--spec-draft-n-max 16 --spec-draft-p-min 0.75`;
- transformers (the anchor, one run): generate() and assisted generation on the torch conversion, bf16.
Cells: batch 1 (one request at a time) on a code, a prose and a summarisation prompt, and 4 concurrent requests
(4 chat prompts; llama-server with -np 4). Each system runs all its cells once a round, in an order reversed every other
round, so that a drift of the machine's speed within a round does not fall on the same system every round; a cell's
figure is the median over rounds of output tokens / seconds end to end (the prompt's processing included). Ratios are
taken within the run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batch_prompts import BATCH_PROMPTS  # benchmarks/batch_prompts.py: the service script sends the same

from dsde_bench.provenance import code_version, run_meta
from dsde_bench.rounds import round_policies
from dsde_bench.workloads import load_workload
from dsde_core.config import EngineConfig, SamplingParams
from dsde_core.llm import SpeculativeLLM
from dsde_core.models.llama_cpp import embedded_gguf
from dsde_core.models.loader import DEFAULT_DRAFT, DEFAULT_TARGET
from dsde_core.policies import SpeculationPolicy, make_policy

PROMPTS = {
    "code": "Write a Python function `merge_intervals(intervals)` that merges overlapping intervals. "
            "Include a docstring, type hints and a few doctest examples.",
    "prose": "Write a short story about a lighthouse keeper who finds a message in a bottle. "
             "Describe the sea, the weather and what the keeper feels.",
}
BATCH = "chat x4"  # the cell of 4 concurrent requests
SERVER_DRAFTS = {"llama-server": None, "llama-server:draft": (),
                 "llama-server:draft-n16-p0.75": ("--spec-draft-n-max", "16", "--spec-draft-p-min", "0.75")}

Cell = tuple[list[list[int]], float, dict]  # (each request's output token ids, seconds, speculation figures)


def prompts(llm: SpeculativeLLM) -> dict[str, list[list[int]]]:
    """Each cell's requests as token ids: code and prose (above), one summarisation prompt of the ACLSum workload,
    and 4 chat prompts for the concurrent cell."""
    summ = load_workload("summ", n=1, seed=1)[0].text
    texts = {**{k: [v] for k, v in PROMPTS.items()}, "summ": [summ], BATCH: BATCH_PROMPTS[:4]}
    return {cell: [llm.encode(t, chat=True) for t in ts] for cell, ts in texts.items()}


def ours(llm: SpeculativeLLM, policy: SpeculationPolicy, n: int) -> Callable[[list[list[int]]], Cell]:
    """Our engine with `policy` (one object across runs: what it learns stays, as in a server)."""
    params = SamplingParams(max_tokens=n, ignore_eos=True)

    def run(cell: list[list[int]]) -> Cell:
        t0 = time.perf_counter()
        outs = llm.generate(cell, params, policy=policy)
        secs = time.perf_counter() - t0
        steps, drafted, accepted = (sum(getattr(o.stats, k) for o in outs) for k in ("steps", "drafted", "accepted"))
        return [o.token_ids for o in outs], secs, {"mean_sl": drafted / max(steps, 1),
                                                   "acceptance": accepted / drafted if drafted else None}

    return run


def server_runs(binary: Path, draft: tuple[str, ...] | None, cells: dict[str, list[list[int]]], n: int) -> dict:
    """One round of llama-server on every cell: -np 1 for the single requests, -np 4 for the concurrent cell; each
    server warmed by one short request before it is timed."""
    from dsde_bench.llama_server import LlamaServer

    tgt, drf = embedded_gguf(DEFAULT_TARGET), embedded_gguf(DEFAULT_DRAFT)
    out = {}
    for parallel, names in ((1, [c for c in cells if c != BATCH]), (4, [BATCH])):
        with LlamaServer(binary, tgt, None if draft is None else drf, parallel=parallel, extra=draft or ()) as s:
            s.complete(cells[names[0]][0], 8)
            for name in names:
                results: list[list[int] | None] = [None] * len(cells[name])

                def one(i: int, ids: list[int], s: Any = s, results: list = results) -> None:
                    results[i] = s.complete(ids, n)[0]

                threads = [threading.Thread(target=one, args=(i, ids)) for i, ids in enumerate(cells[name])]
                t0 = time.perf_counter()
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                out[name] = ([r or [] for r in results], time.perf_counter() - t0, {})
    return out


def anchor(llm: SpeculativeLLM, cells: dict[str, list[list[int]]], n: int) -> dict[str, dict[str, Cell]]:
    """transformers on the torch conversion, bf16, once per single-request cell: generate(), assisted generation with
    its default schedule and with the "heuristic" one."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from dsde_bench.backend import hf_dir

    target = AutoModelForCausalLM.from_pretrained(hf_dir(llm.target), dtype=torch.bfloat16).eval()
    draft = AutoModelForCausalLM.from_pretrained(hf_dir(llm.draft), dtype=torch.bfloat16).eval()
    heuristic = copy.copy(draft)
    heuristic.generation_config = copy.deepcopy(draft.generation_config)
    heuristic.generation_config.num_assistant_tokens_schedule = "heuristic"
    threads = torch.get_num_threads()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    out: dict[str, dict[str, Cell]] = {}
    try:
        for name, assistant in (("transformers:generate", None), ("transformers:assisted", draft),
                                ("transformers:assisted-heuristic", heuristic)):
            for cell, reqs in cells.items():
                if cell == BATCH:
                    continue
                x = torch.tensor(reqs[:1])
                t0 = time.perf_counter()
                with torch.inference_mode():
                    y = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                                        do_sample=False, assistant_model=assistant,
                                        pad_token_id=llm.tokenizer.eos_token_id)
                out.setdefault(name, {})[cell] = ([y[0, x.shape[1]:].tolist()], time.perf_counter() - t0, {})
                print(f"{name:34} {cell:8} {n / out[name][cell][1]:7.2f} tok/s", flush=True)
    finally:
        torch.set_num_threads(threads)
    return out


def rounds(systems: dict[str, Callable[[], dict[str, Cell]]], n: int, cells: list[str]
           ) -> dict[str, dict[str, list[Cell]]]:
    """Every system's cells once a round for n rounds, the systems' order reversed every other round; each round's
    tokens/s printed as it ends."""
    runs: dict[str, dict[str, list[Cell]]] = {name: {} for name in systems}
    print(f"{'round':5} {'system':34} " + " ".join(f"{c:>9}" for c in cells) + "   (tok/s)", flush=True)
    for r in range(n):
        for name in round_policies(list(systems), r, "alternate"):
            got = systems[name]()
            for cell, res in got.items():
                runs[name].setdefault(cell, []).append(res)
            print(f"{r:5} {name:34} " + " ".join(f"{sum(map(len, got[c][0])) / got[c][1]:9.2f}" if c in got else
                                                  f"{'-':>9}" for c in cells), flush=True)
    return runs


def summarise(runs: dict[str, dict[str, list[Cell]]]) -> dict[str, dict]:
    """Per cell and system: median tokens/s over rounds, every round's, the ratio to our target-only's, whether the
    tokens equal our target-only's, and our speculation figures (the median round's)."""
    base = "ours:target-only"
    out: dict[str, dict] = {}
    for system, cells in runs.items():
        for cell, rs in cells.items():
            rates = [sum(map(len, toks)) / secs for toks, secs, _ in rs]
            mid = sorted(range(len(rs)), key=rates.__getitem__)[len(rs) // 2]
            out.setdefault(cell, {})[system] = {"tok_s": statistics.median(rates), "tok_s_runs": rates,
                                                "tokens": rs[-1][0], **rs[mid][2]}
    for systems in out.values():
        ref = systems.get(base)
        for v in systems.values():
            if ref:
                v["vs_target_only"] = v["tok_s"] / ref["tok_s"]
                v["identical"] = v["tokens"] == ref["tokens"]
        for v in systems.values():
            del v["tokens"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="rounds (default 3)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--policies", default="off,dsde-goodput,dsde,static:3", help="our rows (off: target-only)")
    ap.add_argument("--threads", type=int, default=None, help="every system's threads (default: every core)")
    ap.add_argument("--no-peer", action="store_true", help="leave llama-server out (it is built on first use)")
    ap.add_argument("--no-anchor", action="store_true", help="leave transformers out")
    ap.add_argument("--out", default="results/perf.json")
    args = ap.parse_args()
    code = code_version()  # the commit the figures are measured with
    n = args.max_tokens
    llm = SpeculativeLLM.load(config=EngineConfig(max_batch_size=4, backend="llama.cpp", num_threads=args.threads),
                              policy="off")
    cells = prompts(llm)
    systems: dict[str, Callable[[], dict[str, Cell]]] = {}
    for spec in args.policies.split(","):
        name = "ours:target-only" if spec == "off" else f"ours:{spec}"
        run = ours(llm, make_policy(spec), n)
        for reqs in cells.values():  # untimed: the first run of each shape and what a policy learns first
            run(reqs)
        systems[name] = lambda run=run: {c: run(reqs) for c, reqs in cells.items()}
    if not args.no_peer:
        from dsde_bench.llama_server import ensure_llama_server

        binary = ensure_llama_server()
        for name, draft in SERVER_DRAFTS.items():
            systems[name] = lambda draft=draft: server_runs(binary, draft, cells, n)

    runs = rounds(systems, args.runs, list(cells))
    if not args.no_anchor:
        for name, got in anchor(llm, cells, n).items():
            runs[name] = {cell: [res] for cell, res in got.items()}
    results = {"max_tokens": n, "runs": args.runs, "cells": summarise(runs),
               "prompts_tokens": {c: [len(r) for r in reqs] for c, reqs in cells.items()},
               "backend": {"target": llm.target.backend, "draft": llm.draft.backend, "dtype": "q4_k_m (GGUF)"},
               "meta": run_meta(code)}
    _print(results["cells"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


def _print(cells: dict[str, dict]) -> None:
    systems = list(dict.fromkeys(s for v in cells.values() for s in v))
    print(f"\n{'system':34} " + " ".join(f"{c:>18}" for c in cells))
    for s in systems:
        row = [cells[c].get(s) for c in cells]
        print(f"{s:34} " + " ".join(f"{v['tok_s']:8.2f} ({v.get('vs_target_only', 0):4.2f}x)" if v else f"{'-':>18}"
                                    for v in row))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
