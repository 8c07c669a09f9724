"""DSDE Serve benchmark harness: real workloads, the policy grid on the in-process engine, a trace-driven simulator
with an oracle, a streaming HTTP client, and the BENCHMARKS.md generator.

    workloads     real prompts from pinned data packages (chat, code, math, summ, qa, mixed)
    backend       the engine + encoder under test (the embedded pair, or a tiny random pair)
    metrics       the arithmetic of a cell; vllm-bench-serve style serving figures
    recording     a policy wrapper that keeps per-step SL / KLD / WVIR series
    runner        the grid on the in-process engine (`dsde bench`)
    anchor        transformers' assisted generation on the same prompts
    trace         per-prompt traces of the target's greedy path with the draft's rollouts
    simulator     replay of any policy on traces, cost models, the oracle (`dsde bench --simulate`)
    validate      the simulator against the real engine
    serve_client  streaming OpenAI-compatible client (`dsde bench --url`)
    plots, report PNG figures and BENCHMARKS.md
    cli           `dsde bench` (add_arguments / run) and `python -m dsde_bench`
"""
