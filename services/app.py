"""The app builder for `serve run` / `serve deploy` (import_path: services.app:build_app) and `dsde serve`.

    serve run services.app:build_app draft=qwen2.5-coder-0.5b-instruct policy=dsde max_batch_size=8

`args` are ServiceConfig's fields (models, dtype, engine shape, actor resources and placement; see services/config.py)
plus an optional `user_config` (PolicyConfig's fields: policy, params, cap, max_sl) and an optional
`autoscaling_config` (Serve's: min_replicas, max_replicas, target_ongoing_requests, ...; docs/scaling.md). A config
file's deployment-level `user_config` takes precedence and can be changed live: Serve then calls `reconfigure()` on
the running replica, which swaps the policy for requests that arrive afterwards without reloading the models. A config
file's deployment-level `autoscaling_config` (or `num_replicas`) likewise replaces whatever the args set: build_app
never sets `num_replicas`, so the two never meet.
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from services.config import PolicyConfig, ServiceConfig, autoscaling_config
from services.ingress import DSDEServer


def build_app(args: dict[str, Any] | None = None) -> Application:
    args = dict(args or {})
    user_config = args.pop("user_config", None)
    autoscaling = args.pop("autoscaling_config", None)
    cfg = ServiceConfig.from_args(args)  # ConfigError here fails the deploy with a clear message
    options = deployment_options(cfg)
    if user_config is not None:
        PolicyConfig.from_dict(user_config)
        options["user_config"] = user_config
    if autoscaling is not None:
        options["autoscaling_config"] = autoscaling_config(cfg, autoscaling, options["max_ongoing_requests"])
    return DSDEServer.options(**options).bind(cfg)


def deployment_options(cfg: ServiceConfig) -> dict[str, Any]:
    """Serve's side of the load limits: the replica takes every request the engine may hold plus headroom (it
    answers the excess with 429 itself, quickly), and Serve queues a bounded number in front of it (503 past that).
    On shutdown or redeploy Serve lets running requests finish for graceful_shutdown_timeout_s. No num_replicas:
    Serve's default (1), or the config file's num_replicas or autoscaling_config."""
    return {"max_ongoing_requests": cfg.max_ongoing_requests, "max_queued_requests": cfg.max_ongoing_requests,
            "graceful_shutdown_timeout_s": cfg.graceful_shutdown_timeout_s}
