"""Tokens/s through the service (HTTP, streaming) against the in-process engine on the same prompts. Not a test.

    .venv/bin/python benchmarks/service_throughput.py [--max-tokens 128] [--batch 8] [--policy dsde] [--rounds 3]
        [--json results/service_throughput.json]
    .venv/bin/python benchmarks/service_throughput.py --idle-profile 30
    .venv/bin/python benchmarks/service_throughput.py --busy-profile
    .venv/bin/python benchmarks/service_throughput.py --step-split [--rounds 3]
    .venv/bin/python benchmarks/service_throughput.py --beside [--companies none,serve,pair,memory,ticker,app]
        [--rounds 3]

The embedded pair, greedy, chat prompts, all `--batch` requests at once (continuous batching with batch-size
slots). In-process (dsde_core's SpeculativeLLM), then `--rounds` times: a local Ray cluster with the app
(services.app.build_app) and `--batch` concurrent streaming requests over HTTP (httpx, SSE), the cluster stopped,
and in-process again. Throughput is generated tokens / wall time from the first request sent to the last token
received, after one warm-up request each. This machine's speed drifts by 10-20% over minutes, so each service run
is set against the mean of the in-process runs just before and after it, and the figure is the median of those
ratios. The goal: service >= 0.9 x in-process.

Where the difference goes: in each round, once the app is up (and 5 s more) and before the burst, the in-process
engine runs the same prompts again beside the idle cluster (Ray's processes, Serve's controller, proxy and replica,
the model actors waiting). Its throughput against the in-process runs without a cluster ("idle cluster" ratio) is
what the cluster's presence costs a run on these cores; the service against it ("path" ratio) is what the service's
own path costs (actor calls a step, HTTP, streaming, admission). `--idle-profile SECONDS` starts the app alone,
leaves it idle and prints the CPU each process of the machine took over SECONDS: where the cluster's presence goes.
`--busy-profile` prints the CPU each process took for one run of the prompts in-process and one burst of them
through the service (both after a warm-up run): where the path's CPU goes, process by process.
`--step-split` runs the same engine three ways: in-process, in this process driving the model actors and the
controller by plain actor calls (the replica's path without Serve, HTTP or streaming), and as the service; the two
engines print where their steps' time went (propose, verify, the rest): whether the path's cost is the models in
actors or Serve, HTTP and streaming. `--actors-alone` sets the in-process engine against the same engine driving
model actors on a Ray cluster with nothing else. `--beside` drives one set of model actors with each of `--companies`
up beside them in turn (nothing; Serve alone; a second idle pair of model actors; an idle actor holding as much
memory; an idle actor whose thread wakes every 50 ms; the app up and idle): which part of the app's company slows
the models in actors.

The cluster runs its workers at nice 0, as `dsde serve` does: at Ray's default of 15 any other busy process
on the machine starves the model actors and the comparison with the nice-0 in-process run means nothing
(--worker-niceness 15 restores Ray's default). On a machine shared with other CPU-bound work the ratio is noise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from batch_prompts import BATCH_PROMPTS as PROMPTS  # benchmarks/batch_prompts.py: perf.py's batch runs send the same

from dsde_bench.ports import free_port
from dsde_bench.provenance import code_version, run_meta
from dsde_core.config import EngineConfig, SamplingParams
from dsde_core.llm import SpeculativeLLM

if TYPE_CHECKING:  # the service side is imported where it is used: a bad flag fails before Ray's import
    import psutil

    from dsde_core.engine import Engine
    from services.config import ServiceConfig
    from services.launch import LocalServe
    from services.placement import Actors


Run = tuple[float, list[str], int]  # tok/s, texts, tokens


def load_in_process(args: argparse.Namespace, batch: int) -> SpeculativeLLM:
    config = EngineConfig(max_batch_size=batch, dtype=args.dtype, num_threads=args.threads)
    llm = SpeculativeLLM.load(config=config, policy=args.policy)
    llm.generate(["Hello"], SamplingParams(max_tokens=4), chat=True)  # warm-up
    return llm


def in_process(llm: SpeculativeLLM, prompts: list[str], args: argparse.Namespace) -> Run:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    t0 = time.perf_counter()
    results = llm.generate(prompts, params, policy=args.policy, chat=True)
    seconds = time.perf_counter() - t0
    tokens = sum(len(r.token_ids) for r in results)
    return tokens / seconds, [r.text for r in results], tokens


async def _stream(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> tuple[str, int]:
    body = {"model": "dsde", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    text, tokens = "", 0
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                text += choice["delta"].get("content") or ""
    return text, tokens


async def burst(url: str, prompts: list[str], max_tokens: int) -> Run:
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0)) as client:
        await _stream(client, url, prompts[0], 4)  # warm-up
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_stream(client, url, p, max_tokens) for p in prompts))
        seconds = time.perf_counter() - t0
    tokens = sum(n for _, n in results)
    return tokens / seconds, [t for t, _ in results], tokens


SETTLE_S = 5.0  # after serve.run returns, before anything is timed: past the tail of the cluster's start-up


def _cluster_options(args: argparse.Namespace) -> LocalServe:
    from services.launch import LocalServe

    return LocalServe(port=free_port(), num_cpus=2, metrics_port=None, worker_niceness=args.worker_niceness,
                      prometheus_sd=None)


def _service_args(args: argparse.Namespace, batch: int) -> dict[str, Any]:
    """The ServiceConfig args every service-side run here uses (the app's, and the actors the engine drives)."""
    return {"dtype": args.dtype, "policy": args.policy, "num_threads": args.threads, "max_batch_size": batch}


@contextlib.contextmanager
def serving(batch: int, args: argparse.Namespace) -> Iterator[str]:
    """A local Ray cluster with the app up (as `dsde serve` starts it); yields its chat completions URL."""
    from ray import serve

    from services.app import build_app
    from services.launch import local_cluster

    opts = _cluster_options(args)
    with local_cluster(opts):
        serve.run(build_app({"model_name": "dsde", **_service_args(args, batch)}), name="bench", route_prefix="/")
        yield f"{opts.url}/v1/chat/completions"


def through_service(llm: SpeculativeLLM, prompts: list[str], args: argparse.Namespace) -> tuple[Run, Run]:
    """(the service's burst, the in-process engine's run beside the idle cluster just before it)."""
    with serving(len(prompts), args) as url:
        time.sleep(SETTLE_S)
        beside = in_process(llm, prompts, args)
        return asyncio.run(burst(url, prompts, args.max_tokens)), beside


CpuTimes = dict["psutil.Process", tuple[float, dict[int, float]]]  # (user + system seconds, per thread id)


def _cpu_seconds() -> CpuTimes:
    """Every process of the machine (this one included): its user + system CPU seconds so far, and each thread's."""
    import psutil

    seconds = {}
    for p in psutil.process_iter(["pid", "cmdline", "name"]):
        with contextlib.suppress(psutil.Error):
            seconds[p] = (sum(p.cpu_times()[:2]), {t.id: t.user_time + t.system_time for t in p.threads()})
    return seconds


def _thread_name(pid: int, tid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    return "?"


def _print_cpu(title: str, before: CpuTimes, seconds: float) -> None:
    """The CPU each process took since `before` (a busy one's threads too), as a share of one core over `seconds` of
    wall time. Ray's processes are named by their command line's first words."""
    import psutil

    now = _cpu_seconds()
    used = []  # (seconds, pid, command, [(seconds, thread id)])
    for p, (t0, threads0) in before.items():
        if p in now:  # not exited since
            t1, threads1 = now[p]
            cmd = " ".join(p.info["cmdline"] or [p.info["name"] or "?"])
            threads = sorted(((t - threads0.get(tid, 0.0), tid) for tid, t in threads1.items()), reverse=True)
            used.append((t1 - t0, p.pid, cmd[:90], threads))
    used.sort(reverse=True)
    total = sum(u[0] for u in used)
    print(f"{title}, {seconds:.1f} s: {total:.1f} CPU seconds, {100 * total / seconds:.1f}% of one core in all "
          f"({100 * total / seconds / (psutil.cpu_count() or 1):.1f}% of the machine)")
    for u, pid, cmd, threads in used:
        if u / seconds >= 0.001:
            print(f"{100 * u / seconds:6.2f}%  {u:7.2f} s  {pid:7d}  {cmd}")
        if u / seconds >= 0.2:  # a busy process: its threads too
            for tu, tid in threads:
                if tu / seconds >= 0.001:
                    print(f"         {100 * tu / seconds:6.2f}%  thread {tid} {_thread_name(pid, tid)}")


def idle_profile(seconds: float, args: argparse.Namespace) -> None:
    """CPU each process of the machine takes while the app is up and idle."""
    with serving(args.batch, args):
        time.sleep(SETTLE_S)
        before = _cpu_seconds()
        time.sleep(seconds)
        _print_cpu("idle app", before, seconds)


def busy_profile(args: argparse.Namespace) -> None:
    """CPU each process takes for the same work in-process and through the service (both warmed up first): where
    the service's path spends what the in-process engine does not (this process holds the HTTP client)."""
    prompts = PROMPTS[: args.batch]
    llm = load_in_process(args, len(prompts))
    in_process(llm, prompts, args)
    before, t0 = _cpu_seconds(), time.perf_counter()
    run = in_process(llm, prompts, args)
    _print_cpu(f"in-process, {run[2]} tokens at {run[0]:.2f} tok/s", before, time.perf_counter() - t0)
    del llm
    with serving(len(prompts), args) as url:
        asyncio.run(burst(url, prompts, args.max_tokens))
        before, t0 = _cpu_seconds(), time.perf_counter()
        run = asyncio.run(burst(url, prompts, args.max_tokens))
        _print_cpu(f"service, {run[2]} tokens at {run[0]:.2f} tok/s", before, time.perf_counter() - t0)


def _engine_run(engine: Engine, tokenizer: Any, prompts: list[str], args: argparse.Namespace) -> tuple[Run, str]:
    """One run of the prompts on an engine (chat, greedy): the run, and where its steps' time went (its step log)."""
    from dsde_core.llm import encode_prompt

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    since = len(engine.step_log)
    t0 = time.perf_counter()
    reqs = [engine.add_request(encode_prompt(tokenizer, p, True), params) for p in prompts]
    engine.run()
    seconds = time.perf_counter() - t0
    steps = list(engine.step_log)[since:]
    draft, target, total = (sum(getattr(x, f) for x in steps) for f in ("draft_s", "target_s", "total_s"))
    tokens = sum(len(r.output_ids) for r in reqs)
    where = (f"{len(steps)} steps, {total:.2f} s in steps: propose {draft:.2f} s, verify {target:.2f} s, rest "
             f"(plan, observe, commit, admission) {total - draft - target:.2f} s; "
             f"outside steps {seconds - total:.2f} s")
    return (tokens / seconds, [r.text for r in reqs], tokens), where


def _actor_engine(actors: Actors, cfg: ServiceConfig) -> Engine:
    """dsde_core's engine in this process over the actors by plain actor calls, as the replica builds it (without
    its metrics wrapper)."""
    from dsde_core.engine import Engine
    from services import transport
    from services.proxies import ControllerProxy, DraftProxy, TargetProxy

    transport.register()  # as the replica does
    info = actors.target_info
    return Engine(TargetProxy(actors.target), DraftProxy(actors.draft), ControllerProxy(actors.controller),
                  info.tokenizer, cfg.engine_config(), eos_ids=info.eos_ids, vocab_size=info.vocab_size)


def identical(first: list[str], texts: list[str]) -> str:
    """How many of a run's outputs equal the first run's (greedy: every run of a mode should give the same)."""
    return f"{sum(a == b for a, b in zip(first, texts, strict=True))} of {len(texts)} outputs as the first run's"


def print_medians(runs: dict[str, list[float]]) -> None:
    """Each kind of run's median tokens/s and its runs."""
    for name, values in runs.items():
        print(f"{name}: median {statistics.median(values):.2f} tok/s of {[round(v, 2) for v in values]}")


def step_split(args: argparse.Namespace) -> None:
    """The in-process engine; then, with the app up, `--rounds` times the same engine in this process driving a
    second set of model actors and controller through plain actor calls (as the replica does, without Serve, HTTP
    or streaming) and the service's burst; then the in-process engine again (reloaded: three copies of the models do
    not fit in 24 GiB). Tokens/s and, for the engines, where a step's time went: the service's path split into what
    the models in actors cost and what Serve, HTTP and streaming cost."""
    from services.config import PolicyConfig, ServiceConfig
    from services.placement import start_actors

    prompts = PROMPTS[: args.batch]
    runs: dict[str, list[float]] = {"in-process": [], "engine here, models in actors": [], "service": []}
    first: list[str] = []  # the first run's outputs

    def report(name: str, run: Run, where: str = "") -> None:
        runs[name].append(run[0])
        first[:] = first or run[1]
        print(f"{name}: {run[2]} tokens at {run[0]:.2f} tok/s, {identical(first, run[1])}"
              f"{'; ' + where if where else ''}", flush=True)

    def local_run() -> None:
        llm = load_in_process(args, len(prompts))
        in_process(llm, prompts, args)  # warm-up; sets the policy
        report("in-process", *_engine_run(llm.engine, llm.tokenizer, prompts, args))

    local_run()
    with serving(len(prompts), args) as url:
        cfg = ServiceConfig.from_args({**_service_args(args, len(prompts)), "draft_num_cpus": 0, "target_num_cpus": 0})
        actors = start_actors(cfg, PolicyConfig(policy=cfg.policy))  # the app's hold the cluster's logical CPUs
        try:
            engine, tokenizer = _actor_engine(actors, cfg), actors.target_info.tokenizer
            _engine_run(engine, tokenizer, prompts, args)  # warm-up
            asyncio.run(burst(url, prompts, args.max_tokens))  # warm-up
            time.sleep(SETTLE_S)
            for _ in range(args.rounds):
                report("engine here, models in actors", *_engine_run(engine, tokenizer, prompts, args))
                report("service", asyncio.run(burst(url, prompts, args.max_tokens)))
        finally:
            actors.kill()
    local_run()
    print_medians(runs)


def _timed(host: type, method: str) -> type:
    """`host` whose `method` adds the seconds spent inside it to `spent`; `seconds()` reads it."""
    def timed(self: Any, *call_args: Any) -> Any:
        t0 = time.perf_counter()
        out = getattr(host, method)(self, *call_args)
        self.spent += time.perf_counter() - t0
        return out

    return type(f"Timed{host.__name__}", (host,), {"spent": 0.0, method: timed, "seconds": lambda self: self.spent})


class TimedActors:
    """One set of model actors whose propose and verify time themselves, and the engine in this process driving them
    by plain actor calls (start it on a running cluster)."""

    def __init__(self, cfg: ServiceConfig) -> None:
        from services.actors import DraftHost, TargetHost
        from services.config import PolicyConfig
        from services.placement import start_actors

        actors = start_actors(cfg, PolicyConfig(policy=cfg.policy),
                              hosts=(_timed(TargetHost, "verify"), _timed(DraftHost, "propose")))
        self.engine, self.tokenizer = _actor_engine(actors, cfg), actors.target_info.tokenizer
        self._timed = [actors.draft, actors.target]

    def _inside(self) -> list[float]:
        import ray

        return ray.get([actor.seconds.remote() for actor in self._timed])

    def run(self, prompts: list[str], args: argparse.Namespace) -> tuple[Run, str]:
        """_engine_run on the actors; where the time went ends with how long propose and verify took inside them
        (the rest of a call is Ray's)."""
        before = self._inside()
        run, where = _engine_run(self.engine, self.tokenizer, prompts, args)
        spent = [a - b for a, b in zip(self._inside(), before, strict=True)]
        return run, f"{where}; inside the actors: propose {spent[0]:.2f} s, verify {spent[1]:.2f} s"


def actors_alone(args: argparse.Namespace) -> None:
    """The in-process engine and the same engine driving model actors and a controller by plain actor calls on a Ray
    cluster with nothing else on it (no Serve, no app), `--rounds` times round-robin: the engines' step times, and
    how long propose and verify took inside the actors (the rest of a call is Ray's)."""
    from services.config import ServiceConfig
    from services.launch import local_cluster

    prompts = PROMPTS[: args.batch]
    llm = load_in_process(args, len(prompts))
    in_process(llm, prompts, args)  # warm-up; sets the policy
    cfg = ServiceConfig.from_args(_service_args(args, len(prompts)))
    runs: dict[str, list[float]] = {"in-process": [], "engine here, models in actors": []}
    with local_cluster(_cluster_options(args), with_serve=False):
        actors = TimedActors(cfg)
        first = actors.run(prompts, args)[0][1]  # warm-up
        for _ in range(args.rounds):
            run, where = _engine_run(llm.engine, llm.tokenizer, prompts, args)
            runs["in-process"].append(run[0])
            print(f"in-process: {run[2]} tokens at {run[0]:.2f} tok/s, {identical(first, run[1])}; {where}",
                  flush=True)
            run, where = actors.run(prompts, args)
            runs["engine here, models in actors"].append(run[0])
            print(f"engine here, models in actors: {run[2]} tokens at {run[0]:.2f} tok/s, {identical(first, run[1])}; "
                  f"{where}", flush=True)
    print_medians(runs)


COMPANIES = ("none", "serve", "pair", "memory", "ticker", "app")
TICK_S = 0.05  # the ticker's period: as dsde_core.async_engine.AsyncEngine's idle_wait_s
PAIR_GB = 7.5  # memory in use rises by this much when an idle pair of model actors starts here (bf16), for "memory"


class _Ballast:
    """An idle actor holding `gb` GiB it has written to (every page resident): memory in use without models."""

    def __init__(self, gb: float) -> None:
        self.block = bytearray(int(gb * 2**30))
        self.block[:: 4096] = b"\1" * len(range(0, len(self.block), 4096))

    def ready(self) -> bool:
        return True


class _Ticker:
    """An idle actor whose thread wakes every TICK_S and goes back to sleep, as an idle engine loop does."""

    def __init__(self) -> None:
        import threading

        self.stop = threading.Event()
        threading.Thread(target=self._tick, daemon=True).start()

    def _tick(self) -> None:
        while not self.stop.wait(TICK_S):
            pass

    def ready(self) -> bool:
        return True


@contextlib.contextmanager
def _company(name: str, cfg: ServiceConfig, args: argparse.Namespace) -> Iterator[None]:
    """What runs beside the measured actors: nothing; Serve alone (controller and HTTP proxy, no app); a second pair
    of model actors and controller, idle (~7.5 GiB more in use, no Serve); an idle actor holding as much memory as
    that pair and nothing else; an idle actor whose thread wakes every TICK_S; the app up and idle (Serve, its replica
    and the replica's own model actors)."""
    import ray
    from ray import serve

    from services.app import build_app
    from services.config import PolicyConfig
    from services.placement import start_actors

    with contextlib.ExitStack() as stop:  # each company stopped however its run ends
        if name == "pair":
            stop.callback(start_actors(cfg, PolicyConfig(policy=cfg.policy)).kill)
        elif name in ("memory", "ticker"):
            idle = (ray.remote(_Ballast).options(num_cpus=0).remote(PAIR_GB) if name == "memory"
                    else ray.remote(_Ticker).options(num_cpus=0).remote())
            stop.callback(ray.kill, idle)
            ray.get(idle.ready.remote())
        elif name in ("serve", "app"):
            opts = _cluster_options(args)
            serve.start(http_options={"host": opts.host, "port": opts.port})
            stop.callback(serve.shutdown)
            if name == "app":
                serve.run(build_app({"model_name": "dsde", **_service_args(args, cfg.max_batch_size)}), name="bench",
                          route_prefix="/")
        yield


def _company_cpu(before: CpuTimes) -> str:
    """The CPU every process but this one and the measured (timed) model actors took since `before`: the company's
    share of the 2 cores while the engine ran, and the processes that took most of it."""
    used = []
    for p, (t1, _) in _cpu_seconds().items():
        cmd = " ".join(p.info["cmdline"] or [p.info["name"] or "?"])
        if p in before and p.pid != os.getpid() and not cmd.startswith("ray::Timed"):
            used.append((t1 - before[p][0], cmd.split()[0].rsplit("/", 1)[-1]))
    used.sort(reverse=True)
    most = ", ".join(f"{name} {u:.2f} s" for u, name in used[:5])
    return f"the rest of the machine {sum(u for u, _ in used):.2f} CPU s (most: {most})"


def with_company(args: argparse.Namespace) -> None:
    """The engine in this process driving one set of model actors by plain actor calls (as `--actors-alone`), with
    each of `--companies` up beside them in turn, `--rounds` times round-robin (each company started before its
    run and stopped after it): which part of the app's company slows the model actors. Propose and verify are also
    timed inside the actors."""
    import psutil

    from services.config import ServiceConfig
    from services.launch import local_cluster

    prompts = PROMPTS[: args.batch]
    service_args = _service_args(args, len(prompts))
    cfg = ServiceConfig.from_args(service_args)
    runs: dict[str, list[float]] = {name: [] for name in args.companies}
    with local_cluster(_cluster_options(args), with_serve=False):
        # no logical CPUs for the measured set: a company's actors (the app's, a second pair) hold the cluster's
        actors = TimedActors(ServiceConfig.from_args({**service_args, "draft_num_cpus": 0, "target_num_cpus": 0}))
        first = actors.run(prompts, args)[0][1]  # warm-up
        for r in range(args.rounds):
            for name in args.companies:
                with _company(name, cfg, args):
                    time.sleep(SETTLE_S)
                    in_use, cpu_before = psutil.virtual_memory().used / 2**30, _cpu_seconds()
                    run, where = actors.run(prompts, args)
                    others = _company_cpu(cpu_before)
                runs[name].append(run[0])
                print(f"round {r + 1}, beside {name} ({in_use:.1f} GiB of memory in use): {run[2]} tokens at "
                      f"{run[0]:.2f} tok/s, {identical(first, run[1])}; {where}; {others}", flush=True)
    print_medians(runs)
    reference = args.companies[0]
    for name in args.companies[1:]:
        ratios = [a / b for a, b in zip(runs[name], runs[reference], strict=True)]
        print(f"beside {name} / beside {reference}, round by round: {[round(x, 3) for x in ratios]}, median "
              f"{statistics.median(ratios):.3f}")


def _companies(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or any(n not in COMPANIES for n in names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"a comma-separated list of distinct names from {', '.join(COMPANIES)}")
    return names


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, choices=range(1, len(PROMPTS) + 1), metavar=f"1..{len(PROMPTS)}")
    p.add_argument("--policy", default="dsde")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=None, help="torch threads (both runs; default: all cores)")
    p.add_argument("--worker-niceness", type=int, default=0, help="Ray's worker niceness (default 0, as dsde serve)")
    p.add_argument("--rounds", type=int, default=3, help="service runs, each between two in-process runs")
    p.add_argument("--json", type=Path, default=None, help="also write the figures to this file")
    p.add_argument("--idle-profile", type=float, default=None, metavar="SECONDS",
                   help="instead: start the app, leave it idle and print each process's CPU over SECONDS")
    p.add_argument("--busy-profile", action="store_true",
                   help="instead: print each process's CPU for one run in-process and one burst through the service")
    p.add_argument("--step-split", action="store_true",
                   help="instead: in-process, the engine driving model actors without Serve, and the service "
                        "(the last two --rounds times round-robin); tokens/s and the engines' step times")
    p.add_argument("--actors-alone", action="store_true",
                   help="instead: in-process and the engine driving model actors on a Ray cluster without Serve, "
                        "--rounds times round-robin; step times, and propose and verify timed inside the actors")
    p.add_argument("--beside", action="store_true",
                   help="instead: the engine driving model actors with each of --companies up beside them in turn, "
                        "--rounds times round-robin; tokens/s, step times, propose and verify inside the actors")
    p.add_argument("--companies", type=_companies, default=list(COMPANIES),
                   help=f"with --beside: what runs beside the actors, in order (default {','.join(COMPANIES)}; the "
                        "first is the reference of the printed ratios)")
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.idle_profile is not None:
        if args.idle_profile <= 0:
            p.error("--idle-profile must be > 0 seconds")
        idle_profile(args.idle_profile, args)
        return 0
    if args.busy_profile:
        busy_profile(args)
        return 0
    if args.step_split:
        step_split(args)
        return 0
    if args.actors_alone:
        actors_alone(args)
        return 0
    if args.beside:
        with_company(args)
        return 0
    prompts = PROMPTS[: args.batch]
    code = code_version()  # the commit the figures are measured with (BENCHMARKS.md names a run that predates a change)
    llm = load_in_process(args, len(prompts))  # stays loaded (idle) while a service runs: ~5 GB beside its actors
    local = [in_process(llm, prompts, args)]
    print(f"in-process: {local[0][2]} tokens, {local[0][0]:.2f} tok/s", flush=True)
    service, beside, ratios, idle, path = [], [], [], [], []
    for r in range(args.rounds):
        run, run_beside = through_service(llm, prompts, args)  # Ray is started and stopped around each service run
        service.append(run)
        beside.append(run_beside)
        local.append(in_process(llm, prompts, args))
        # the machine drifts over minutes: each service run against the mean of the in-process runs around it
        around = (local[-2][0] + local[-1][0]) / 2
        ratios.append(service[-1][0] / around)
        idle.append(beside[-1][0] / around)
        path.append(service[-1][0] / beside[-1][0])
        print(f"round {r + 1}: service {service[-1][2]} tokens, {service[-1][0]:.2f} tok/s (HTTP streaming, "
              f"{len(prompts)} at once); in-process beside the idle cluster {beside[-1][0]:.2f} tok/s, after the "
              f"cluster {local[-1][0]:.2f} tok/s; ratio {ratios[-1]:.3f} (idle cluster {idle[-1]:.3f}, path "
              f"{path[-1]:.3f})", flush=True)
    ratio = statistics.median(ratios)
    local_texts = local[0][1]
    same = [sum(a == b for a, b in zip(local_texts, texts, strict=True)) for _, texts, _ in service]
    print(f"ratio service / in-process: median {ratio:.3f} of {[round(x, 3) for x in ratios]} (goal >= 0.9); "
          f"identical outputs per service run: {same} of {len(prompts)}")
    print(f"of which the idle cluster (in-process beside it / without it): median {statistics.median(idle):.3f}; "
          f"the service's path (service / in-process beside the cluster): median {statistics.median(path):.3f}")
    if args.json:
        summary = {"in_process_tok_s": statistics.median(x[0] for x in local),
                   "in_process_runs": [x[0] for x in local],
                   "service_tok_s": statistics.median(x[0] for x in service),
                   "service_runs": [x[0] for x in service], "ratios": ratios, "ratio": ratio,
                   "beside_idle_cluster_runs": [x[0] for x in beside], "idle_cluster_ratios": idle,
                   "idle_cluster_ratio": statistics.median(idle), "path_ratios": path,
                   "path_ratio": statistics.median(path),
                   "tokens": [local[0][2], service[0][2]], "identical": min(same), "batch": len(prompts),
                   "max_tokens": args.max_tokens, "policy": args.policy, "dtype": args.dtype,
                   "rounds": args.rounds, "meta": run_meta(code)}
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
