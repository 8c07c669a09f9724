"""Batch-1 greedy decode speed: our ModelRunner vs transformers' generate(), same weights, same dtype.

    python benchmarks/runner_speed.py [--model qwen2.5-coder-1.5b-instruct] [--new-tokens 64] [--threads 2]

Both sides time prefill + new_tokens greedy steps; tokens/s = new_tokens / wall time, best of --repeats runs
that alternate between the two.
"""

from __future__ import annotations

import argparse
import time

import torch

from dsde_core.models.loader import DEFAULT_TARGET, load_model
from dsde_core.models.runner import ModelRunner

PROMPT = "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces."


def ours_greedy(runner: ModelRunner, ids: list[int], new_tokens: int) -> list[int]:
    runner.set_length(0, 0)
    logits = runner.forward([0], [ids], [1])
    out = []
    for _ in range(new_tokens):
        tok = int(logits[0].argmax())
        out.append(tok)
        if len(out) == new_tokens:
            break
        logits = runner.forward([0], [[tok]], [1])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_TARGET)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    from transformers import AutoModelForCausalLM

    loaded = load_model(args.model, dtype=dtype)
    tok = loaded.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True)
    ids = tok(text)["input_ids"]
    n = args.new_tokens
    runner = ModelRunner(loaded.model, num_slots=1, max_seq_len=len(ids) + n + 8)
    hf = AutoModelForCausalLM.from_pretrained(loaded.path, dtype=dtype).eval()

    def hf_greedy_n(n: int) -> list[int]:
        # eos_token_id=None and min_new_tokens: generate always produces exactly n tokens
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([ids]),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=tok.pad_token_id,
            )
        return out[0, len(ids) :].tolist()

    ours_greedy(runner, ids, 4), hf_greedy_n(4)  # warm-up (kernel selection, first touch of memory)
    # alternate the two (this machine's speed drifts), keep the best time of each
    t_ours = t_hf = float("inf")
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        ours = ours_greedy(runner, ids, n)
        t1 = time.perf_counter()
        gen = hf_greedy_n(n)
        t2 = time.perf_counter()
        t_ours, t_hf = min(t_ours, t1 - t0), min(t_hf, t2 - t1)
        print(f"  run: ours {n / (t1 - t0):.2f} tokens/s, transformers {n / (t2 - t1):.2f} tokens/s", flush=True)
    same = sum(a == b for a, b in zip(ours, gen, strict=False))
    print(f"model {loaded.name}  dtype {args.dtype}  threads {args.threads}  prompt {len(ids)} tokens  new {n}")
    print(f"ours         {n / t_ours:6.2f} tokens/s  ({t_ours:.2f} s)")
    print(f"transformers {n / t_hf:6.2f} tokens/s  ({t_hf:.2f} s)  generate(do_sample=False)")
    print(f"speedup {t_hf / t_ours:.2f}x   identical greedy tokens: {same}/{n}")
    print("ours:", repr(tok.decode(ours)[:200]))


if __name__ == "__main__":
    main()
