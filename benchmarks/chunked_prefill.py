"""Chunked prefill: how long a long prompt's arrival stalls the requests already decoding, with and without it.

    python benchmarks/chunked_prefill.py [--chunks none,512,256] [--long-lines 100] [--rounds 3] [--policy dsde]
                                         [--draft-window N] [--dtype bfloat16]

Three chat requests decode (the embedded Qwen pair, in-process, bf16 on the CPU); once each has 8 tokens, a prompt of
--long-lines numbered lines (about 13 tokens a line) arrives. For each EngineConfig.prefill_chunk setting (none: the
whole prompt in one step), per round: the longest gap between two emissions of a decoding request while the long
prompt is fed, the long request's time to first token, and the wall time of all four requests. Rounds alternate the
settings; the table prints medians. Outputs are compared with the first setting's: in float32 (--dtype float32) they
must be equal; in bf16 a chunk's matmuls round differently from the whole prompt's, so a near-tie may go the other way
(as a different batch does). The same budget bounds the draft's prefill of the prompt at the request's
first drafting step (--policy off has no draft step; --draft-window bounds it too).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

from dsde_core.config import EngineConfig, SamplingParams
from dsde_core.llm import SpeculativeLLM
from dsde_core.request import RequestOutput

SHORT = ["Write a Python function that reverses a linked list.", "Explain what a hash map is in two sentences.",
         "List three uses of the bisect module."]


def long_prompt(lines: int) -> str:
    body = "\n".join(f"Line {i}: the value of item {i} is {i * 7 % 13}." for i in range(lines))
    return f"{body}\nWhich items have the value 3? Answer with their numbers."


def one_round(llm: SpeculativeLLM, chunk: int | None, lines: int) -> tuple[dict[str, float], list[list[int]]]:
    engine = llm.engine
    engine.config = replace(engine.config, prefill_chunk=chunk)
    times: dict[str, list[float]] = {}

    def sink(out: RequestOutput) -> None:
        if out.token_ids:
            times.setdefault(out.req_id, []).append(time.perf_counter())

    params = SamplingParams(max_tokens=64, ignore_eos=True)
    t0 = time.perf_counter()
    short = [engine.add_request(llm.encode(p, True), params, on_output=sink) for p in SHORT]
    while min(len(r.output_ids) for r in short) < 8:
        engine.step()
    arrival = time.perf_counter()
    long = engine.add_request(llm.encode(long_prompt(lines), True), SamplingParams(max_tokens=16, ignore_eos=True),
                              on_output=sink)
    engine.run()
    first = times[long.req_id][0]
    gaps = [b - a for r in short for a, b in zip(times[r.req_id], times[r.req_id][1:], strict=False)
            if b >= arrival and a <= first]  # the gaps while the long prompt was fed
    figures = {"max_stall_s": max(gaps, default=0.0), "long_ttft_s": first - arrival,
               "wall_s": time.perf_counter() - t0, "prompt_tokens": len(long.prompt_ids)}
    return figures, [r.output_ids for r in short + [long]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunks", default="none,512,256", help="prefill_chunk settings, comma-separated (none: off)")
    p.add_argument("--long-lines", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--policy", default="dsde")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--draft-window", type=int, default=None, help="EngineConfig.draft_window (default: off)")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 (the service's default) or float32")
    args = p.parse_args()
    chunks = [None if c.strip().lower() == "none" else int(c) for c in args.chunks.split(",")]
    config = EngineConfig(max_batch_size=4, max_seq_len=4096, num_threads=args.threads,
                          draft_window=args.draft_window, dtype=args.dtype)
    llm = SpeculativeLLM.load(config=config, policy=args.policy)
    results: dict[int | None, list[dict[str, float]]] = {c: [] for c in chunks}
    outputs: dict[int | None, list[list[int]]] = {}
    one_round(llm, None, 20)  # warm-up
    for i in range(args.rounds):
        for c in chunks:
            figures, outputs[c] = one_round(llm, c, args.long_lines)
            results[c].append(figures)
            print(f"round {i + 1} prefill_chunk={c}: " + ", ".join(f"{k}={v:.2f}" for k, v in figures.items()),
                  flush=True)
    print(f"\npolicy {args.policy}, {args.dtype}, draft_window {args.draft_window}, "
          f"{int(results[chunks[0]][0]['prompt_tokens'])}-token prompt, medians of {args.rounds} rounds")
    for c in chunks[1:]:  # where each request's greedy output first differs from the first setting's (none: equal)
        firsts = [next((j for j, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), None)
                  for x, y in zip(outputs[chunks[0]], outputs[c], strict=True)]
        print(f"prefill_chunk={c}: outputs equal to prefill_chunk={chunks[0]}'s: {firsts == [None] * len(firsts)} "
              f"(first differing token per request: {firsts})")
    print("| prefill_chunk | longest stall of a decoding request (s) | long prompt's TTFT (s) | wall (s) |")
    print("|---|---|---|---|")
    for c in chunks:
        med = {k: statistics.median(f[k] for f in results[c]) for k in ("max_stall_s", "long_ttft_s", "wall_s")}
        print(f"| {c or 'none'} | {med['max_stall_s']:.2f} | {med['long_ttft_s']:.2f} | {med['wall_s']:.2f} |")


if __name__ == "__main__":
    main()
