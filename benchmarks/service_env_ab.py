"""The service's tokens/s under different environments of the Ray cluster's processes, A/B in one run. Not a test.

    .venv/bin/python benchmarks/service_env_ab.py --variant default= --variant spin10k=GOMP_SPINCOUNT=10000 \\
        [--rounds 3] [--max-tokens 128] [--batch 8]

Each round starts one cluster per variant in turn (the variables set in this process before `ray.init`, so every
Ray process inherits them: the model actors' libgomp reads them when it loads), checks that the target actor sees
them, runs one warm-up burst and one timed burst of `--batch` streaming chat requests (as
benchmarks/service_throughput.py does), and stops the cluster. Round-robin, so a round's variants share the
machine's phase; the figure per variant is the median over rounds. What it was written for: whether torch's OpenMP
threads, which spin after each call (libgomp's GOMP_SPINCOUNT, OMP_WAIT_POLICY), take the CPU from the other
model actor on a 2-core machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import psutil
from service_throughput import PROMPTS, SETTLE_S, burst, print_medians, serving


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """'name=KEY=VALUE,KEY2=VALUE2' (or 'name=' for no variables) -> (name, {KEY: VALUE, ...})."""
    name, sep, rest = text.partition("=")
    if not name or not sep:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=[KEY=VALUE[,KEY=VALUE...]]")
    env = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not key or not sep:
            raise argparse.ArgumentTypeError(f"{item!r} in {text!r}: expected KEY=VALUE")
        env[key] = value
    return name, env


def actor_env(keys: set[str]) -> dict[str, str | None]:
    """The variables as the target actor's process sees them."""
    for p in psutil.process_iter(["cmdline"]):
        if p.info["cmdline"] and "TargetHost" in p.info["cmdline"][0]:
            env = p.environ()
            return {k: env.get(k) for k in sorted(keys)}
    return {}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", type=parse_variant, action="append", required=True, help="NAME=[KEY=VALUE,...]")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, choices=range(1, len(PROMPTS) + 1), metavar=f"1..{len(PROMPTS)}")
    p.add_argument("--policy", default="dsde")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if len({name for name, _ in args.variant}) != len(args.variant):
        p.error("--variant names must differ")
    args.threads, args.worker_niceness = None, 0  # as service_throughput's defaults
    keys = {k for _, env in args.variant for k in env}
    base = {k: os.environ.get(k) for k in keys}
    prompts = PROMPTS[: args.batch]
    runs: dict[str, list[float]] = {name: [] for name, _ in args.variant}
    for r in range(args.rounds):
        for name, env in args.variant:
            for k, v in base.items():  # this process's own values, then the variant's
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            os.environ.update(env)
            with serving(len(prompts), args) as url:
                time.sleep(SETTLE_S)
                seen = actor_env(keys)
                asyncio.run(burst(url, prompts, 16))
                tok_s, _, tokens = asyncio.run(burst(url, prompts, args.max_tokens))
            runs[name].append(tok_s)
            print(f"round {r + 1} {name}: {tok_s:.2f} tok/s ({tokens} tokens); the target actor sees {seen}",
                  flush=True)
    print_medians(runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
