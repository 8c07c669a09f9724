"""DSDE Serve's benchmarks: real workloads, the policy grid on the in-process engine, a trace-driven simulator with an
oracle, a streaming HTTP client, and the report (BENCHMARKS.md). The command line is `dsde bench` (dsde_cli.bench).

    workloads     real prompts from pinned data packages (chat, code, math, summ, qa, mixed)
    backend       the engine + encoder under test (the embedded pair, or a tiny random pair)
    metrics       the arithmetic of a cell; vllm-bench-serve style serving figures
    recording     a policy wrapper that keeps per-step SL / KLD / WVIR series
    rounds, probe the order and seeds of a repeated cell's rounds; a fixed forward timed as the machine's speed
    runner        the grid on the in-process engine
    anchor        transformers' assisted generation on the same prompts
    bound         DSDE's SL bound picked for the machine
    sim/          the trace-driven simulator: traces, cost profiles, the replay and oracle, its validation
    serve_client  streaming OpenAI-compatible client (`dsde bench --url`)
    provenance    which code and machine a run's figures describe
    ports         free TCP ports for servers a benchmark starts
    plots         PNG figures
    report/       BENCHMARKS.md and results/<run>.md from results/*.json
"""
