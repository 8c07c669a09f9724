"""The trace-driven simulator (`dsde bench --simulate`): record once what a policy can observe, replay every policy on
it under any step-cost profile, and check the replay against the engine.

    trace      per-prompt traces of the target's greedy path with the draft's rollouts
    costs      step-cost profiles (measured, engine, cpu, gpu, costs files) and the tables a cost-aware policy sees
    simulator  the replay, the oracle and the sweep over policies x batch sizes x profiles
    validate   the replay's target forwards per token against the engine's on the same prompts
"""
