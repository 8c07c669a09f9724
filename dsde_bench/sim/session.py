"""`dsde bench --simulate` end to end: traces recorded once and cached, the cost profiles built (the machine's step
costs measured once and cached too), every policy replayed under each profile, and the replay checked against the
engine on the traced prompts."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsde_bench.backend import Backend
from dsde_bench.runner import ROW_HEADER, WARM_SEED_OFFSET, format_row, other_prompts
from dsde_bench.sim.costs import (
    CostModel,
    builtin_profile,
    fit_engine_steps,
    load_costs_file,
    measure_costs,
    parse_profile,
)
from dsde_bench.sim.simulator import DEFAULT_SIM_POLICIES, make_sim_policy, sweep
from dsde_bench.sim.trace import Trace, record
from dsde_bench.sim.validate import validate
from dsde_bench.workloads import DEFAULT_MAX_CHARS, Prompt, load_workload
from dsde_core.errors import ConfigError


@dataclass(frozen=True)
class SimulateConfig:
    workloads: tuple[str, ...]
    num_prompts: int
    max_tokens: int
    horizon: int  # draft rollout recorded per position: the engine's max SL
    backend: dict[str, Any]  # draft, target, dtype, draft_noise (and the runners): what a cached trace or cost
    # table must match
    results_dir: Path = Path("results")  # where bench.json is read (profile 'engine') and costs.json kept
    profiles: tuple[str, ...] = ("measured", "gpu")
    costs: tuple[str, ...] = ()  # NAME=FILE: a costs file as profile NAME
    policies: tuple[str, ...] = DEFAULT_SIM_POLICIES
    batch_sizes: tuple[int, ...] = (1, 4, 16)
    seed: int = 1
    max_chars: int = DEFAULT_MAX_CHARS
    warm_requests: int = 0  # a policy that learns across requests first serves a trace of this many other prompts
    num_requests: int | None = None
    closed: bool = False  # each group of `batch` prompts a closed batch with a fresh policy
    validate: bool = False
    validate_batch_sizes: tuple[int, ...] = (1,)
    validate_policies: tuple[str, ...] | None = None  # default: every replayed policy but the oracle
    remeasure: bool = False
    traces_dir: Path | None = None  # default $XDG_CACHE_HOME/dsde/traces: traces hold the data sets' token ids
    tag: str = ""  # names the pair in trace and costs files ("tiny" for the random pair)

    def check(self) -> dict[str, CostModel]:
        """The costs files, and every profile parsed once, before any trace is recorded or step cost measured."""
        if self.closed and self.num_requests is not None:
            raise ConfigError("--sim-closed runs each prompt once: drop --sim-requests")
        files = {}
        for item in self.costs:
            name, eq, path = item.partition("=")
            if not eq or not name.strip() or not path.strip():
                raise ConfigError(f"--costs takes NAME=FILE, got {item!r}")
            files[name.strip()] = load_costs_file(name.strip(), path.strip())
        bench = self.results_dir / "bench.json"
        if "engine" in self._bases() and not bench.exists():
            raise ConfigError(f"cost profile 'engine' fits the step timings of {bench}: run `dsde bench` first")
        stand_in = builtin_profile("cpu")  # for 'measured' and 'engine', which exist only later
        for spec in self.profiles:
            parse_profile(spec, stand_in, stand_in, files)
        return files

    def _bases(self) -> set[str]:
        return {p.split(":")[0] for p in self.profiles}  # the profiles' names, without their overrides


def default_traces_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "dsde" / "traces"


def prompts_sha(prompts: Sequence[Prompt]) -> str:
    h = hashlib.sha256()
    for p in prompts:
        h.update(p.text.encode("utf-8"))
    return h.hexdigest()[:16]


def trace_path(cfg: SimulateConfig, workload: str, prompts: Sequence[Prompt], seed: int, batch: int | None) -> Path:
    """The cached trace's file; `batch`: recorded that many prompts at a time (None: over all of the slots). Its name
    ends in a key over everything else that decides what is recorded (the pair, its dtype, the draft's noise, the
    prompts' texts), so that a run with another draft or --max-chars records anew instead of replaying this one."""
    tag = "".join(ch if ch.isalnum() or ch in ".-_" else "_" for ch in cfg.tag)
    key = hashlib.sha256(json.dumps([cfg.backend, prompts_sha(prompts)], sort_keys=True).encode()).hexdigest()[:8]
    shape = "" if batch is None else f"-b{batch}"
    return (cfg.traces_dir or default_traces_dir()) / (
        f"{workload}-n{len(prompts)}-seed{seed}-t{cfg.max_tokens}-h{cfg.horizon}{shape}-{tag}-{key}.json")


def run(cfg: SimulateConfig, load_backend: Callable[[], Backend], meta: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The sweep's results document; the engine is loaded only when a trace or a cost table must be made."""
    files, loaded = cfg.check(), []

    def backend() -> Backend:
        loaded[:] = loaded or [load_backend()]
        return loaded[0]

    def trace_of(w: str, prompts: list[Prompt], seed: int, what: str, batch: int | None = None) -> Trace:
        path = trace_path(cfg, w, prompts, seed, batch)
        if path.exists():
            print(f"{what} {w}: {path} (cached)", file=sys.stderr)
            return Trace.load(path)
        b, t0 = backend(), time.perf_counter()
        tr = record(b.engine.target.runner, b.engine.draft.runner, [b.encode(p.text) for p in prompts],
                    [p.id for p in prompts], cfg.max_tokens, cfg.horizon, eos_ids=b.engine.eos_ids,
                    top_k=b.engine.config.draft_top_k, slots=None if batch is None else list(range(batch)),
                    workload=w, backend=b.description)
        tr.meta = {"seed": seed, "record_s": time.perf_counter() - t0, "prompt_texts_sha": prompts_sha(prompts),
                   "batch": batch}
        tr.save(path)
        print(f"{what} {w}: recorded in {time.perf_counter() - t0:.1f} s -> {path}", file=sys.stderr)
        return tr

    # a warm-up trace only where a policy of the sweep keeps state across requests (the others skip it)
    n_warm = cfg.warm_requests if any(make_sim_policy(p).pooled for p in cfg.policies) else 0
    # The validation's traces are recorded as few prompts at a time as it runs the engine: in bf16 a forward's
    # numbers depend on its batch's shape, so a batched trace and a batch-1 run can part at a near-tie, a difference
    # of the recording and not of the replay, which is what the validation checks.
    trace_batch = min(cfg.validate_batch_sizes) if cfg.validate else None
    traces, warm = [], {}
    for w in cfg.workloads:
        prompts = load_workload(w, cfg.num_prompts, cfg.seed, cfg.max_chars)
        traces.append(trace_of(w, prompts, cfg.seed, "trace", trace_batch))
        if n_warm:
            others = other_prompts(w, n_warm, cfg.seed, cfg.max_chars, prompts)
            warm[w] = trace_of(w, others, cfg.seed + WARM_SEED_OFFSET, "warm-up trace")
    measured = _measured(cfg, backend, meta) if "measured" in cfg._bases() else None
    engine = None
    if "engine" in cfg._bases():
        bench = json.loads((cfg.results_dir / "bench.json").read_text())
        engine = fit_engine_steps([r for c in bench.get("steps", []) for r in c["steps"]], beyond=measured)
    profiles = [parse_profile(p, measured, engine, files) for p in cfg.profiles]
    print(f"{'profile':10} " + ROW_HEADER)
    doc = sweep(traces, cfg.policies, cfg.batch_sizes, profiles, num_requests=cfg.num_requests, warm=warm,
                on_cell=lambda c: print(f"{c['profile'][:10]:10} " + format_row({**c, "label": c.get("label",
                                                                                                     c["policy"])})),
                closed=cfg.closed)
    doc["trace_batch"] = trace_batch
    if cfg.validate:
        policies = cfg.validate_policies or [p for p in cfg.policies if p != "oracle"]
        doc["validation"] = validate(backend(), traces, policies, cfg.validate_batch_sizes, print_fn=print)
    return doc


def _measured(cfg: SimulateConfig, backend: Callable[[], Backend], meta: Callable[[], dict[str, Any]]) -> CostModel:
    """This machine's step costs: results/costs.json when it was measured on the same pair, else measured now."""
    path = cfg.results_dir / ("costs-tiny.json" if cfg.tag == "tiny" else "costs.json")
    cached = json.loads(path.read_text()) if path.exists() and not cfg.remeasure else None
    desc = {k: cfg.backend[k] for k in ("draft", "target", "dtype")}
    # the runners when the flags chose them (a table timed on llama.cpp or the eager step prices neither other runner)
    desc |= {k: v for k in ("backend", "draft_backend", "step") if (v := cfg.backend.get(k)) not in (None, "auto")}
    if cached and cached.get("backend") == desc and cached["model"].get("table"):
        return CostModel(**cached["model"])
    b = backend()
    measured = measure_costs(b.engine.target.runner, b.engine.draft.runner)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"backend": desc, "model": measured.__dict__, "meta": meta()}, indent=1))
    print(f"measured step costs -> {path}", file=sys.stderr)
    return measured
