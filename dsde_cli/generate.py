"""`dsde generate` (one prompt through speculative decoding, in-process, no Ray) and `dsde prepare` (the embedded
models joined, verified and converted once, into the cache)."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

from transformers.utils import logging as hf_logging

from dsde_cli.flags import add_backend_flags, add_step_flag
from dsde_core.config import EngineConfig, SamplingParams
from dsde_core.errors import ConfigError
from dsde_core.llm import GenerationResult, SpeculativeLLM
from dsde_core.models.backends import BACKENDS, resolve_backend
from dsde_core.models.loader import DEFAULT_DRAFT, DEFAULT_TARGET
from dsde_core.models.packaged import EMBEDDED, ensure_embedded
from dsde_core.policies import DEFAULT_POLICY, POLICY_NAMES, make_policy


def add_commands(sub: Any) -> dict[str, Callable[[argparse.Namespace], int]]:
    """Add `generate` and `prepare` to an argparse subparsers object; returns their handlers by name."""
    g = sub.add_parser("generate", help="generate text for one prompt and print speculation stats")
    g.add_argument("prompt")
    g.add_argument("--policy", default=DEFAULT_POLICY,
                   help=f"speculation-length policy: {', '.join(POLICY_NAMES)} (static:K for a fixed K, "
                        "dsde:MAX for DSDE with SL_max bounded by MAX)")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--presence-penalty", type=float, default=0.0, help="[-2, 2], OpenAI's")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="[-2, 2], OpenAI's")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="[0.01, 10], 1: none (prompt and output)")
    g.add_argument("--dtype", default="bfloat16", help="bfloat16 (fast) or float32 (bit-exact losslessness)")
    g.add_argument("--device", default="cpu")
    g.add_argument("--threads", type=int, default=None,
                   help="threads of torch and llama.cpp (default: torch's choice, every core for llama.cpp)")
    add_backend_flags(g)
    add_step_flag(g)
    g.add_argument("--draft", default=DEFAULT_DRAFT, help="embedded name, HF model directory or .gguf file")
    g.add_argument("--target", default=DEFAULT_TARGET, help="embedded name, HF model directory or .gguf file")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    g.add_argument("--compare", action="store_true", help="also run target-only decoding and compare")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p = sub.add_parser("prepare", help="join and verify the embedded models once, and convert them for torch (cached)")
    p.add_argument("models", nargs="*", default=list(EMBEDDED), help=f"default: {' '.join(EMBEDDED)}")
    p.add_argument("--backend", default="auto", choices=BACKENDS,
                   help="what to prepare them for: llama.cpp (the joined GGUF file), torch (its safetensors "
                        "conversion, a few minutes the first time), auto (as dsde serve resolves it on the CPU)")
    return {"generate": _generate, "prepare": _prepare}


def _prepare(args: argparse.Namespace) -> int:
    for name in args.models:
        if name not in EMBEDDED:
            raise ConfigError(f"unknown embedded model {name!r}; known: {', '.join(EMBEDDED)}")
    for name in args.models:
        if resolve_backend(args.backend, name, "cpu", "bfloat16") == "llama.cpp":
            from dsde_core.models.llama_cpp import embedded_gguf

            print(f"{name}: {embedded_gguf(name)}")
        else:
            print(f"{name}: {ensure_embedded(EMBEDDED[name])}")
    return 0


def _stats(res: GenerationResult, seconds: float) -> dict[str, Any]:
    s = res.stats
    return {
        "tokens": len(res.token_ids),
        "seconds": seconds,
        "tokens_per_s": len(res.token_ids) / seconds if seconds > 0 else 0.0,
        "acceptance_rate": s.acceptance_rate,
        "mean_accepted_length": s.mean_accepted_length,
        "mean_sl": s.mean_sl,
        "drafted": s.drafted,
        "accepted": s.accepted,
        "target_steps": s.steps,
        "finish_reason": res.finish_reason,
        "stop_reason": res.stop_reason,
        "ttft_s": s.ttft,
    }


def _timed(llm: SpeculativeLLM, prompt_ids: list[int], params: SamplingParams, policy: str
           ) -> tuple[GenerationResult, float]:
    t0 = time.perf_counter()
    [res] = llm.generate([prompt_ids], params, policy=policy)
    return res, time.perf_counter() - t0


def _generate(args: argparse.Namespace) -> int:
    make_policy(args.policy)  # fail on a bad policy before minutes of model loading
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, presence_penalty=args.presence_penalty,
                            frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty)
    config = EngineConfig(max_batch_size=1, dtype=args.dtype, device=args.device, num_threads=args.threads,
                          backend=args.backend, draft_backend=args.draft_backend, step=args.step)
    hf_logging.disable_progress_bar()  # transformers' "Loading weights" bars: this command reports its own lines
    llm = SpeculativeLLM.load(draft=args.draft, target=args.target, config=config)
    ids = llm.encode(args.prompt, args.chat)
    llm.engine.validate(ids, params, "--max-tokens")  # the request itself, before the warm-up (not the user's)
    llm.generate([ids], SamplingParams(max_tokens=min(2, params.max_tokens)), policy="static:2")  # warm-up
    res, secs = _timed(llm, ids, params, args.policy)
    report: dict[str, Any] = {"text": res.text, "token_ids": res.token_ids, "policy": args.policy,
                              "stats": _stats(res, secs)}
    if args.compare:
        base, base_secs = _timed(llm, ids, params, "off")
        report["target_only"] = {"text": base.text, "token_ids": base.token_ids, "stats": _stats(base, base_secs)}
        report["speedup"] = report["stats"]["tokens_per_s"] / max(report["target_only"]["stats"]["tokens_per_s"],
                                                                 1e-9)
        report["identical"] = base.token_ids == res.token_ids
    if args.json:
        print(json.dumps(report))
        return 0
    st = report["stats"]
    print(res.text)
    print(f"\n[{args.policy}] {st['tokens']} tokens in {secs:.2f}s = {st['tokens_per_s']:.2f} tok/s | "
          f"acceptance {st['acceptance_rate']:.1%} | mean accepted length {st['mean_accepted_length']:.2f} | "
          f"mean SL {st['mean_sl']:.2f}")
    if args.compare:
        bt = report["target_only"]["stats"]
        print(f"[target-only] {bt['tokens']} tokens = {bt['tokens_per_s']:.2f} tok/s | speedup "
              f"{report['speedup']:.2f}x | outputs identical: {report['identical']}")
    return 0
