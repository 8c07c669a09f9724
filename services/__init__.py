"""DSDE Serve on Ray: transport, placement, HTTP and metrics around dsde_core's engine; no decoding logic.

    config             ServiceConfig (the app's args) and PolicyConfig (the live user_config), build_policy
    config_file        `dsde check-config`: a Serve config file checked as `serve deploy` would, without a cluster
    actors             DraftHost / TargetHost: a worker and the model it loads, run as Ray actors
    controller         Controller: the policy with per-request state and the SL cap, in generations (reconfigure)
    transport          how a draft proposal crosses processes: packed per proposal, unpacked into row views
    proxies            DraftAPI / TargetAPI / policy interface over plain actor calls, for dsde_core's Engine
    placement          creates the three actors with their resources and waits for the models
    metrics            ray.util.metrics (exported as ray_dsde_*), recorded from outputs and step feedback
    protocol           OpenAI request bodies (pydantic) and the error body
    completion_bodies  completions and chat completions response bodies and SSE chunks
    responses_api      OpenAI's Responses API: the response object and its stream's events
    ingress            the FastAPI app on Ray Serve: owns the engine, serves /v1/completions and friends
    app                build_app(args) for `serve run` / `serve deploy`
    launch             `dsde serve`: a local Ray, the app, the URL, a clean stop on Ctrl-C / SIGTERM
"""
