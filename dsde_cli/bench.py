"""`dsde bench`: the policy grid on the in-process engine (default), the trace-driven simulator (--simulate), or an
HTTP server (--url). Every mode writes results/<mode>.json, its every cell in results/<mode>.md, PNG plots in
results/plots, and regenerates BENCHMARKS.md from all results/*.json. A run with an --out outside results/ (or another
--results-dir) is a scratch run: its table and plots go beside its JSON, in <stem>.md and <stem>_plots/, and
BENCHMARKS.md is left as it is unless --benchmarks-md names a page.

    dsde bench                                   # small grid: code + mixed, 4 prompts, 32 tokens, batch 1 and 4, T=0,
                                                 # off, static:2, static:4, dsde-nocap, dsde, dsde-goodput (~6 min)
    dsde bench --full                            # all workloads and policies, batch 1/4/16, T=0/1, 16 prompts x 128
    dsde bench --simulate [--validate]           # record traces once, then sweep policies x cost profiles in seconds
    dsde bench --url http://127.0.0.1:8000 --concurrency 4
    python -m dsde_bench report                  # regenerate BENCHMARKS.md and results/*.md only
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dsde_bench import provenance
from dsde_bench.probe import PROBE_FORWARDS
from dsde_bench.rounds import ROUND_ORDERS
from dsde_bench.serve_client import ENDPOINTS
from dsde_bench.workloads import DEFAULT_MAX_CHARS, load_workload, parse_workloads
from dsde_cli.flags import add_backend_flags, add_step_flag
from dsde_core.errors import ConfigError, DSDEError

RESULTS, PAGE = "results", "BENCHMARKS.md"  # the published results folder and the page made from it

SMALL_WORKLOADS = "code,mixed"
SIM_DEFAULT_TOKENS = 96


def _comma_list(kind: Callable[[str], Any], what: str) -> Callable[[str], tuple[Any, ...]]:
    """A comma-list flag's type: one value or more (an empty list would otherwise fall back to the flag's default)."""
    def parse(s: str) -> tuple[Any, ...]:
        items = [x.strip() for x in s.split(",") if x.strip()]
        try:
            values = tuple(kind(x) for x in items)
        except ValueError:
            values = ()
        if not values:
            raise argparse.ArgumentTypeError(f"expected a comma list of {what}, got {s!r}")
        return values
    return parse


_floats, _ints, _strs = _comma_list(float, "numbers"), _comma_list(int, "integers"), _comma_list(str, "names")


def _nonblank(s: str) -> str:
    if not s.strip():
        raise argparse.ArgumentTypeError(f"expected a comma list of names or 'all', got {s!r}")
    return s


def _positive(s: str) -> int:
    """A count flag's value (0 would otherwise fall back to the flag's default)."""
    try:
        n = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {s!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {n}")
    return n


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("grid (defaults: the small grid; --full: the whole grid; explicit flags override both)")
    g.add_argument("--workloads", type=_nonblank,
                   help=f"comma list of chat, code, math, summ, qa, mixed, or 'all' (small: {SMALL_WORKLOADS})")
    g.add_argument("--policies", type=_nonblank,
                   help="comma list of policy specs (off, static:K, heuristic, adaedl, acceptance, dsde-nocap, dsde, "
                        "dsde-paper, dsde-goodput), or 'all'")
    g.add_argument("--batch-sizes", type=_ints, help="comma list (small: 1,4; full: 1,4,16)")
    g.add_argument("--temperatures", type=_floats, help="comma list (small: 0; full: 0,1)")
    g.add_argument("--num-prompts", type=_positive, help="prompts per workload (small: 4; full: 16)")
    g.add_argument("--max-tokens", type=_positive, help="new tokens per request (small: 32; full: 128; simulate: 96)")
    g.add_argument("--seed", type=int, default=1, help="prompt sampling and request seeds (default 1)")
    g.add_argument("--max-chars", type=int, default=DEFAULT_MAX_CHARS, help="longest prompt sampled, in characters")
    g.add_argument("--full", action="store_true", help="the whole grid: every workload and policy (hours on a CPU)")
    g.add_argument("--anchor", type=_strs, help="transformers systems at batch 1: hf-assisted, hf-assisted-heuristic, "
                                                "hf-generate (default: the two assisted ones)")
    g.add_argument("--no-anchor", action="store_true", help="skip transformers' assisted generation")
    g.add_argument("--ignore-eos", action="store_true", help="generate max_tokens even after EOS")
    g.add_argument("--length-spread", type=float, default=0.0,
                   help="request i generates max_tokens x (1 - F u_i), u_i uniform in [0, 1) from the seed: with "
                        "--ignore-eos, requests that end apart instead of a batch in lockstep (default 0; the "
                        "in-process grid only, with --no-anchor)")
    g.add_argument("--repeats", type=int, default=1, help="runs per cell, the median run kept (default 1); at T > 0 "
                   "each round samples with new seeds, the same for every policy")
    g.add_argument("--round-order", choices=ROUND_ORDERS, default="alternate",
                   help="the policies' order in a repeated cell's rounds: alternate (every other round reversed, so a "
                        "drift within a round does not fall on the last policy every round; the default) or fixed")
    g.add_argument("--warm-requests", type=int, default=0,
                   help="a policy that learns across requests (dsde-goodput) first serves this many other prompts of "
                        "the workload, untimed: the steady state of a server (default 0: a cold start per cell); "
                        "with --simulate, from a trace of those prompts")
    g.add_argument("--probe-forwards", type=int, default=None,
                   help="before and after every round, time this many fixed target forwards (the median kept as "
                        f"probe_ms): which rounds ran while the machine was slow (default {PROBE_FORWARDS}; 0: none; "
                        "the in-process grid only)")

    m = p.add_argument_group("models")
    m.add_argument("--draft", default=None, help="draft model (embedded name, HF directory or .gguf)")
    m.add_argument("--target", default=None, help="target model")
    m.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                   help="the models' dtype (default bfloat16; --tiny: float32, the only one its pair runs)")
    m.add_argument("--max-sl", type=int, default=20, help="engine ceiling on the speculation length (default 20)")
    m.add_argument("--max-seq-len", type=int, default=2048)
    m.add_argument("--threads", type=int, default=None,
                   help="torch and llama.cpp threads (default: torch's, every core)")
    add_backend_flags(m)
    add_step_flag(m)
    m.add_argument("--draft-noise", type=float, default=0.0,
                   help="std of Gaussian noise on the draft's logits: a deliberately weak draft (default 0)")
    m.add_argument("--draft-window", type=int, default=None, metavar="N",
                   help="EngineConfig.draft_window: the draft takes in only the last N tokens of a prompt (default: "
                        "off, the engine of the published figures; the in-process grid only)")
    m.add_argument("--tiny", action="store_true",
                   help="random-weight tiny pair instead of real models (smoke runs; --draft, --target and --threads "
                        "are refused beside it)")

    s = p.add_argument_group("simulator (--simulate)")
    s.add_argument("--simulate", action="store_true", help="trace-driven replay of every policy, with the oracle")
    s.add_argument("--profiles", type=_strs, default=("measured", "gpu"),
                   help="cost profiles: measured (timed forwards here), engine (fitted from RESULTS/bench.json), "
                        "cpu, gpu, each with optional :key=value,... "
                        "(ratio, knee, base_ms, per_token_ms, padded); default measured,gpu")
    s.add_argument("--costs", type=_strs, default=(),
                   help="NAME=FILE,...: a costs file's measured table as profile NAME (results/costs.json's format, "
                        "e.g. results/gpu/costs_h100.json from benchmarks/gpu_costs.py on a GPU)")
    s.add_argument("--sim-policies", type=_strs, help="policies to replay (default: all, dsde-paper and oracle)")
    s.add_argument("--sim-batch-sizes", type=_ints, default=(1, 4, 16), help="default 1,4,16")
    s.add_argument("--sim-requests", type=_positive, default=None,
                   help="requests per replay (default max(prompts, 2 x batch))")
    s.add_argument("--sim-closed", action="store_true",
                   help="replay each group of BATCH prompts as its own closed batch with a fresh policy, as a "
                        "`dsde bench` cell of BATCH prompts runs them (a cell of more prompts refills each freed "
                        "slot instead; each prompt once; not with --sim-requests)")
    s.add_argument("--horizon", type=_positive, default=None,
                   help="draft rollout recorded per position (default --max-sl)")
    s.add_argument("--traces-dir", default=None,
                   help="where traces are kept (default $XDG_CACHE_HOME/dsde/traces: they hold the prompts' token "
                        "ids, i.e. the data sets' records, which must not be committed)")
    s.add_argument("--validate", action="store_true", help="also run the real engine on the traced prompts (T=0) "
                                                           "and compare target forwards per token")
    s.add_argument("--validate-batch-sizes", type=_ints, default=(1,), help="default 1")
    s.add_argument("--validate-policies", type=_strs, help="default: every replayed policy but the oracle")
    s.add_argument("--remeasure", action="store_true", help="measure the step costs again even if cached")

    v = p.add_argument_group("server mode (--url)")
    v.add_argument("--url", default=None, help="base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    v.add_argument("--api", choices=list(ENDPOINTS), default="chat",
                   help="the endpoint: /v1/chat/completions (default), /v1/completions or /v1/responses")
    v.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    v.add_argument("--concurrency", type=int, default=1, help="requests in flight at most (default 1; 0: unbounded)")
    v.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (default inf)")
    v.add_argument("--api-key", default=None,
                   help="sent as 'Authorization: Bearer KEY' (a server started with --api-key; default $DSDE_API_KEY)")

    o = p.add_argument_group("output")
    o.add_argument("--results-dir", default=RESULTS)
    o.add_argument("--out", default=None, help="results JSON (default RESULTS/{bench,simulate,serve}.json)")
    o.add_argument("--benchmarks-md", default=None,
                   help=f"the page regenerated from RESULTS after the run (default: {PAGE}, and only after a run "
                        f"that writes into the default results folder)")
    o.add_argument("--no-report", action="store_true", help="do not regenerate BENCHMARKS.md")
    o.add_argument("--no-plots", action="store_true")
    o.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    args.code = provenance.code_version()  # the code the run starts with: the checkout may move on during a run
    try:
        _check_mode_flags(args)
        real = {"--draft": args.draft, "--target": args.target, "--threads": args.threads}  # what --tiny cannot honour
        for flag in [f for f, value in real.items() if value is not None and args.tiny]:
            raise ConfigError(f"{flag} sets up a real model; --tiny runs the tiny random pair without it")
        if args.tiny and args.dtype not in (None, "float32"):
            raise ConfigError(f"--dtype {args.dtype}: --tiny runs the tiny random pair in float32 only")
        if args.tiny and "llama.cpp" in (args.backend, args.draft_backend):
            raise ConfigError("--backend llama.cpp: --tiny runs the tiny random pair on torch only")
        args.dtype = args.dtype or ("float32" if args.tiny else "bfloat16")
        if args.draft_window is not None:
            from dsde_core.config import EngineConfig

            EngineConfig(draft_window=args.draft_window)  # a bad N fails now, before any data or model loads
        _check_writable(args, "serve" if args.url else "simulate" if args.simulate else "bench")
        if args.url:
            return _serve(args)
        if args.simulate:
            return _simulate(args)
        return _grid(args)
    except DSDEError as e:  # a bad flag, config or results file; a workload's data package missing
        return _error(e)


# The flags that not every mode reads, and the modes that do: given to another mode, one would be silently ignored.
# The rest (--workloads, --num-prompts, --max-tokens, --seed, --max-chars and the output's) every mode reads.
_GRID, _SIM, _URL = "the in-process grid", "--simulate", "--url"
_MODELS = ("--draft", "--target", "--dtype", "--max-sl", "--max-seq-len", "--threads", "--draft-noise", "--tiny",
           "--backend", "--draft-backend", "--step")
_READ_BY: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("--policies", "--batch-sizes", "--anchor", "--no-anchor", "--ignore-eos", "--length-spread",
                     "--repeats", "--round-order", "--probe-forwards", "--draft-window"), (_GRID,)),
    **dict.fromkeys(("--full", "--warm-requests", *_MODELS), (_GRID, _SIM)),
    "--temperatures": (_GRID, _URL),
    **dict.fromkeys(("--profiles", "--costs", "--sim-policies", "--sim-batch-sizes", "--sim-requests", "--sim-closed",
                     "--horizon", "--traces-dir", "--validate", "--validate-batch-sizes", "--validate-policies",
                     "--remeasure"), (_SIM,)),
    **dict.fromkeys(("--api", "--model", "--concurrency", "--request-rate", "--api-key"), (_URL,)),
}


def _check_mode_flags(args: argparse.Namespace) -> None:
    """A flag given (other than its default) to a mode that does not read it is an error naming the modes that do."""
    defaults = argparse.ArgumentParser()
    add_arguments(defaults)
    mode = _URL if args.url else _SIM if args.simulate else _GRID
    for flag, modes in _READ_BY.items():
        dest = flag[2:].replace("-", "_")
        if mode not in modes and getattr(args, dest) != defaults.get_default(dest):
            readers = " and ".join(modes) + (" reads" if len(modes) == 1 else " read")
            raise ConfigError(f"{flag} does not apply to {mode}: only {readers} it")
    if args.url and args.temperatures and len(args.temperatures) > 1:
        raise ConfigError(f"--url runs one temperature, got {len(args.temperatures)}: run it once per temperature")


def _error(e: DSDEError) -> int:
    """A CLI error: its message on stderr, exit status 2 (as argparse's), no traceback."""
    print(f"error: {e}", file=sys.stderr)
    return 2


# ---- shared --------------------------------------------------------------------------------------------------
_COMMAND: list[str] | None = None  # set by main(argv); `dsde bench` (run(args) alone) reads sys.argv


def command_line(argv: list[str] | None = None) -> str:
    argv = list(argv if argv is not None else (_COMMAND or sys.argv))
    head = "python -m dsde_bench" if argv and argv[0].endswith("__main__.py") else os.path.basename(argv[0] or "dsde")
    return " ".join([head, *(shlex.quote(a) for a in argv[1:])])


def _meta(code: dict[str, Any] | None, plots: list[Path] | None = None) -> dict[str, Any]:
    return provenance.run_meta(code, command_line(), [str(p) for p in plots or []])


def _write(doc: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=_json_default))
    print(f"wrote {path}")


def _json_default(x: Any) -> Any:
    if isinstance(x, float) and math.isinf(x):
        return None
    return str(x)


def _out(args: argparse.Namespace, name: str) -> Path:
    return Path(args.out) if args.out else Path(args.results_dir) / f"{name}.json"


def _page(args: argparse.Namespace, out: Path) -> Path | None:
    """The page the run regenerates: the one --benchmarks-md names, else the published one, but only after a run into
    the published results (a scratch run's --out elsewhere, or another --results-dir, leaves it as it is)."""
    if args.no_report:
        return None
    if args.benchmarks_md:
        return Path(args.benchmarks_md)
    published = Path(RESULTS).resolve()
    return Path(PAGE) if Path(args.results_dir).resolve() == published == out.resolve().parent else None


def _check_writable(args: argparse.Namespace, name: str) -> None:
    """Before a run that may take hours: the folders its files go to exist (or can be made) and take a file."""
    out = _out(args, name)
    page = _page(args, out)
    writes_results = not args.out or args.simulate  # its JSON, or the simulator's measured costs (costs.json)
    folders = ([("--results-dir", Path(args.results_dir))] if writes_results else []) + \
        ([("--out", out.parent)] if args.out else [])
    for flag, folder in folders + ([("--benchmarks-md", page.parent)] if page else []):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=folder):
                pass
        except OSError as e:
            raise ConfigError(f"{flag}: cannot write to {folder} ({e.strerror or e})") from None


def _finish(args: argparse.Namespace, doc: dict[str, Any], name: str, plot_fn: Any) -> int:
    results = Path(args.results_dir)
    default = results / f"{name}.json"
    out = _out(args, name)
    # beside its JSON: a run with another --out leaves the default run's table and plots alone
    md = out.with_suffix(".md")
    plot_dir = results / "plots" if out.resolve() == default.resolve() else out.parent / f"{out.stem}_plots"
    plots: list[Path] = []
    if not args.no_plots:
        plots = plot_fn(doc, plot_dir)
    doc["meta"] = _meta(args.code, plots)
    _write(doc, out)
    from dsde_bench.report import run_page

    md.write_text(run_page(out.stem, doc))
    print(f"wrote {md}" + (f" and {len(plots)} plots in {plot_dir}" if plots else ""))
    if page := _page(args, out):
        from dsde_bench.report import write

        print(f"wrote {write(results, page)}")
    elif not args.no_report:
        print(f"{PAGE} left as it is: a scratch run ({out} is not in {RESULTS}/; --benchmarks-md names a page to "
              f"regenerate)")
    return 0


def backend(args: argparse.Namespace, max_batch: int) -> Any:
    """The engine and encoder the flags name: the tiny random pair (--tiny) or real models."""
    from dsde_bench.backend import load_backend, tiny_backend

    if args.tiny:
        return tiny_backend(max_batch=max_batch, max_sl=args.max_sl, max_seq_len=min(args.max_seq_len, 1024),
                            draft_window=args.draft_window, draft_noise=args.draft_noise, step=args.step)
    kw = {k: v for k, v in (("draft", args.draft), ("target", args.target)) if v}
    print(f"loading models ({args.dtype}) ...", file=sys.stderr)
    return load_backend(dtype=args.dtype, max_batch=max_batch, max_seq_len=args.max_seq_len, max_sl=args.max_sl,
                        num_threads=args.threads, draft_noise=args.draft_noise, draft_window=args.draft_window,
                        backend=args.backend, draft_backend=args.draft_backend, step=args.step, **kw)


def grid_config(args: argparse.Namespace) -> Any:
    """The in-process grid the flags ask for: the small grid by default, --full's, explicit flags over both."""
    from dsde_bench.runner import FULL_GRID, FULL_POLICIES, SMALL_POLICIES, GridConfig

    full = args.full
    pol = args.policies
    policies = FULL_POLICIES if pol == "all" else (_strs(pol) if pol else (FULL_GRID["policies"] if full else
                                                                          SMALL_POLICIES))
    workloads = tuple(parse_workloads(args.workloads or ("all" if full else SMALL_WORKLOADS)))
    anchor = () if args.no_anchor else (args.anchor or ("hf-assisted", "hf-assisted-heuristic"))
    return GridConfig(
        workloads=workloads, policies=tuple(policies),
        batch_sizes=args.batch_sizes or (FULL_GRID["batch_sizes"] if full else (1, 4)),
        temperatures=args.temperatures or (FULL_GRID["temperatures"] if full else (0.0,)),
        num_prompts=args.num_prompts or (FULL_GRID["num_prompts"] if full else 4),
        max_tokens=args.max_tokens or (FULL_GRID["max_tokens"] if full else 32),
        seed=args.seed, max_chars=args.max_chars, anchor=tuple(anchor), ignore_eos=args.ignore_eos,
        repeats=args.repeats, round_order=args.round_order, warm_requests=args.warm_requests,
        length_spread=args.length_spread,
        probe_forwards=PROBE_FORWARDS if args.probe_forwards is None else args.probe_forwards)


# ---- modes ---------------------------------------------------------------------------------------------------
def _grid(args: argparse.Namespace) -> int:
    from dsde_bench.plots import bench_plots
    from dsde_bench.runner import run_grid

    cfg = grid_config(args)
    for w in cfg.workloads:  # fail on a missing data package before loading any model
        load_workload(w, cfg.num_prompts, cfg.seed, cfg.max_chars)
    print(f"dsde bench: {cfg.num_cells()} cells; workloads {','.join(cfg.workloads)}, {cfg.num_prompts} prompts, "
          f"{cfg.max_tokens} tokens, batch {cfg.batch_sizes}, T {cfg.temperatures}", file=sys.stderr)
    doc = run_grid(backend(args, max(cfg.batch_sizes)), cfg, progress=not args.no_progress)
    return _finish(args, doc, "bench", bench_plots)


def _simulate(args: argparse.Namespace) -> int:
    from dsde_bench.plots import simulate_plots
    from dsde_bench.sim import session
    from dsde_bench.sim.simulator import DEFAULT_SIM_POLICIES

    desc = {"draft": "tiny" if args.tiny else (args.draft or "qwen2.5-coder-0.5b-instruct"),
            "target": "tiny" if args.tiny else (args.target or "qwen2.5-coder-1.5b-instruct"), "dtype": args.dtype,
            "backend": args.backend, "draft_backend": args.draft_backend,
            **({"step": args.step} if args.step != "eager" else {})}
    cfg = session.SimulateConfig(
        workloads=tuple(parse_workloads(args.workloads or ("all" if args.full else SMALL_WORKLOADS))),
        num_prompts=args.num_prompts or (16 if args.full else 4),
        max_tokens=args.max_tokens or (128 if args.full else SIM_DEFAULT_TOKENS), horizon=args.horizon or args.max_sl,
        backend={**desc, "draft_noise": args.draft_noise}, results_dir=Path(args.results_dir),
        profiles=tuple(args.profiles), costs=tuple(args.costs),
        policies=tuple(args.sim_policies or DEFAULT_SIM_POLICIES), batch_sizes=tuple(args.sim_batch_sizes),
        seed=args.seed, max_chars=args.max_chars, warm_requests=args.warm_requests, num_requests=args.sim_requests,
        closed=args.sim_closed, validate=args.validate, validate_batch_sizes=tuple(args.validate_batch_sizes),
        validate_policies=args.validate_policies and tuple(args.validate_policies), remeasure=args.remeasure,
        traces_dir=args.traces_dir and Path(args.traces_dir),
        tag="tiny" if args.tiny else f"{desc['target']}-{desc['dtype']}")
    doc = session.run(cfg, lambda: backend(args, max(4, *args.validate_batch_sizes)), lambda: _meta(args.code))
    return _finish(args, doc, "simulate", simulate_plots)


def _serve(args: argparse.Namespace) -> int:
    from dsde_bench.serve_client import ServeConfig, run_serve_sync

    workloads = parse_workloads(args.workloads or "mixed")
    n = args.num_prompts or 16
    cfg = ServeConfig(url=args.url, api=args.api, model=args.model, max_tokens=args.max_tokens or 64,
                      temperature=(args.temperatures or (0.0,))[0], concurrency=args.concurrency or None,
                      request_rate=args.request_rate, seed=args.seed,
                      api_key=args.api_key or os.environ.get("DSDE_API_KEY"))
    runs = []
    for w in workloads:
        prompts = load_workload(w, n, args.seed, args.max_chars)
        res = run_serve_sync(prompts, cfg)
        res["workload"] = w
        m = res["metrics"]
        print(f"{w:8} completed {m['completed']}/{len(prompts)}  out {m['output_throughput']:.2f} tok/s  "
              f"TTFT mean {m['mean_ttft_ms']:.0f} ms p99 {m['p99_ttft_ms']:.0f}  ITL mean {m['mean_itl_ms']:.0f} ms  "
              f"E2EL mean {m['mean_e2el_ms']:.0f} ms p99 {m['p99_e2el_ms']:.0f}")
        if res["errors"]:
            print(f"  errors: {res['errors'][:3]}", file=sys.stderr)
        runs.append(res)
    doc = {"kind": "serve", "runs": runs}
    _finish(args, doc, "serve", lambda d, o: [])
    if not any(r["metrics"]["completed"] for r in runs):  # the results hold the errors; the run measured nothing
        first = next((e for r in runs for e in r["errors"]), "none recorded")
        print(f"error: no request completed; the first error: {first}", file=sys.stderr)
        return 1
    return 0


def _report(argv: list[str]) -> int:
    """python -m dsde_bench report [--results DIR] [--out PAGE] [--plots]: the page and results/*.md (and optionally
    the PNGs)."""
    from dsde_bench.plots import bench_plots, simulate_plots
    from dsde_bench.report import write

    p = argparse.ArgumentParser(prog="python -m dsde_bench report", description="regenerate BENCHMARKS.md")
    p.add_argument("--results", default=RESULTS)
    p.add_argument("--out", default=PAGE)
    p.add_argument("--plots", action="store_true", help="also redraw the PNGs from the JSON documents")
    a = p.parse_args(argv)
    if a.plots:
        for name, fn in (("bench", bench_plots), ("simulate", simulate_plots)):
            path = Path(a.results) / f"{name}.json"
            if path.exists():
                doc = json.loads(path.read_text())
                doc.setdefault("meta", {})["plots"] = [str(x) for x in fn(doc, Path(a.results) / "plots")]
                path.write_text(json.dumps(doc, indent=1))
                print(f"redrew {len(doc['meta']['plots'])} plots of {path}")
    try:
        print(f"wrote {write(a.results, a.out)}")
    except DSDEError as e:  # a results file it cannot read: named, and the page left as it was
        return _error(e)
    return 0


def add_commands(sub: Any) -> dict[str, Callable[[argparse.Namespace], int]]:
    """Add `bench` to the `dsde` command's subparsers; returns its handler by name."""
    b = sub.add_parser("bench", help="every SL policy against the baselines: real runs, simulator, or a server",
                       description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_arguments(b)
    return {"bench": run}


def main(argv: list[str] | None = None) -> int:
    """`python -m dsde_bench [FLAGS]` (as `dsde bench`) and `python -m dsde_bench report`."""
    global _COMMAND
    argv = list(sys.argv[1:] if argv is None else argv)
    _COMMAND = ["__main__.py", *argv]
    if argv[:1] == ["report"]:
        return _report(argv[1:])
    p = argparse.ArgumentParser(prog="dsde bench", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))
