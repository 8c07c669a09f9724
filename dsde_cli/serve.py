"""`dsde serve` (the OpenAI-compatible service on a local Ray cluster, services.launch) and `dsde check-config` (a
Serve config file read as `serve deploy` would, services.config_file, without a cluster). services/ and Ray are
imported only when a command runs."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dsde_cli.flags import add_backend_flags, add_step_flag
from dsde_core.models.loader import DEFAULT_DRAFT, DEFAULT_TARGET
from dsde_core.policies import DEFAULT_POLICY, POLICY_NAMES

if TYPE_CHECKING:
    from services.launch import LocalServe


def add_commands(sub: Any) -> dict[str, Callable[[argparse.Namespace], int]]:
    """Add `serve` and `check-config` to an argparse subparsers object; returns their handlers by name."""
    _add_serve(sub)
    _add_check_config(sub)
    return {"serve": _serve, "check-config": _check_config}


def _add_serve(sub: Any) -> None:
    s = sub.add_parser("serve", help="serve the OpenAI-compatible API on a local Ray cluster (Ctrl-C stops it)")
    s.add_argument("--draft", default=DEFAULT_DRAFT, help="embedded name, HF model directory or .gguf file; "
                                                          "'none' for target-only serving")
    s.add_argument("--target", default=DEFAULT_TARGET, help="embedded name, HF model directory or .gguf file")
    s.add_argument("--model-name", default=None, help="the model name clients send (default: the target's)")
    s.add_argument("--policy", default=DEFAULT_POLICY,
                   help=f"initial policy: {', '.join(POLICY_NAMES)} (static:K, dsde:MAX; default {DEFAULT_POLICY})")
    s.add_argument("--dtype", default="bfloat16", help="bfloat16 (fast) or float32")
    s.add_argument("--device", default="auto", help="auto (cuda when an actor has a GPU), cpu or cuda[:N]")
    s.add_argument("--max-batch-size", type=int, default=8, help="KV slots: sequences decoded together")
    s.add_argument("--max-seq-len", type=int, default=2048, help="context window per sequence")
    s.add_argument("--draft-window", type=int, default=None, metavar="N",
                   help="the draft takes in only the last N tokens of a prompt "
                        "(docs/policies.md, Draft window; default: off)")
    s.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="chunked prefill: the most prompt tokens each model takes in a step, while the running "
                        "requests decode (docs/policies.md, Chunked prefill; default 4096; 0: no limit)")
    s.add_argument("--threads", type=int, default=None,
                   help="torch and llama.cpp threads per model actor (default: all cores)")
    add_backend_flags(s)
    add_step_flag(s)
    s.add_argument("--num-gpus", type=float, default=0.0, help="GPUs for each model actor (default 0)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--metrics-port", type=int, default=8080, help="Prometheus endpoint of Ray's metrics export")
    s.add_argument("--prometheus-sd", default="auto", metavar="FILE",
                   help="Prometheus service-discovery file to write while serving (default 'auto': Ray's, "
                        "/tmp/ray/prom_metrics_service_discovery.json, which deploy/prometheus/prometheus.yml reads; "
                        "'none': write none)")
    s.add_argument("--num-cpus", type=int, default=None, help="Ray's logical CPUs (default: the machine's)")
    s.add_argument("--worker-niceness", type=int, default=0,
                   help="nice level of Ray's workers, the model actors included (default 0; Ray's own default is 15)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: $DSDE_API_KEY)")
    s.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait for a KV slot; more get 429 with Retry-After (default 64)")
    s.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds before an unfinished request ends with 504 (default 600)")


def _serve(args: argparse.Namespace) -> int:
    try:
        from services.launch import serve_forever
        opts = local_serve(args)
    except ImportError as e:
        print(f"dsde: error: `dsde serve` needs the serve extra ({e}); run make setup or "
              f"pip install -e '.[serve]'", file=sys.stderr)
        return 2
    return serve_forever(opts, log=lambda msg: print(msg, flush=True))


def local_serve(args: argparse.Namespace) -> LocalServe:
    """`dsde serve`'s flags as services.launch.LocalServe: the app's ServiceConfig arguments and the local cluster's."""
    from services.launch import LocalServe

    app_args = {"draft": args.draft, "target": args.target, "model_name": args.model_name, "policy": args.policy,
                "dtype": args.dtype, "device": args.device, "max_batch_size": args.max_batch_size,
                "max_seq_len": args.max_seq_len, "num_threads": args.threads,
                "backend": args.backend, "draft_backend": args.draft_backend, "step": args.step,
                "draft_num_gpus": args.num_gpus, "target_num_gpus": args.num_gpus, "max_queue": args.max_queue,
                "request_timeout_s": args.request_timeout}
    if args.api_key:
        app_args["api_key"] = args.api_key
    if args.draft_window is not None:
        app_args["draft_window"] = args.draft_window
    if args.prefill_chunk is not None:
        app_args["prefill_chunk"] = None if args.prefill_chunk == 0 else args.prefill_chunk
    return LocalServe(app_args, host=args.host, port=args.port, num_cpus=args.num_cpus,
                      metrics_port=args.metrics_port or None, worker_niceness=args.worker_niceness,
                      prometheus_sd=None if args.prometheus_sd.lower() == "none" else args.prometheus_sd)


def _add_check_config(sub: Any) -> None:
    c = sub.add_parser("check-config", help="check a Serve config file (serve deploy FILE); with a cluster to ask, "
                                            "also whether its actors can be placed there")
    c.add_argument("file", help="a Serve config file, e.g. deploy/config.yaml")
    c.add_argument("--address", default=None,
                   help="a running Ray cluster to check the placement against: its dashboard (http://HOST:8265, as "
                        "serve deploy -a) or its GCS address (HOST:6379, auto); default $RAY_ADDRESS; without "
                        "either only the config itself is checked")


def _check_config(args: argparse.Namespace) -> int:
    """Each application in one line, a note for a model source that is not on this machine (on a cluster it must be
    on every node, which this machine cannot see) and one for a policy that asks for more than the engine's max_sl
    lets a step draft; a problem is an error naming the application and field. With --address (or $RAY_ADDRESS),
    a placement the cluster's nodes cannot hold is an error naming the role and the resource."""
    from dsde_core.errors import ConfigError
    from dsde_core.models.loader import model_source_exists
    from services.config_file import check_config_file, cluster_nodes, unplaced

    apps = check_config_file(args.file)
    address = args.address or os.environ.get("RAY_ADDRESS") or None
    nodes = cluster_nodes(address) if address and any(app.config for app in apps) else None
    for app in apps:
        print(app.describe())
        if app.config is None:
            continue
        if where := app.placement():
            print(f"  {where}")
        sources = (app.config.target, app.config.draft)
        for source in [s for s in sources if s is not None and not model_source_exists(s)]:
            print(f"  note: model {source!r} is not on this machine; every node that runs a replica needs it")
        for note in [*app.notes, app.ceiling_note()]:
            if note:
                print(f"  note: {note}")
        if nodes is None:
            print("  note: placement not checked against a cluster (no --address or $RAY_ADDRESS): only its shape")
        elif problems := unplaced(app.config, nodes):
            raise ConfigError(f"{args.file}: application {app.name!r}: cannot be placed on the cluster at {address} "
                              f"({len(nodes)} nodes): {'; '.join(problems)}")
        else:
            print(f"  placement: one replica's actors fit the cluster at {address} ({len(nodes)} nodes)")
    print(f"{args.file}: ok")
    return 0
