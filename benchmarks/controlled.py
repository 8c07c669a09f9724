"""The engine's speed at a controlled acceptance rate, for models whose own drafts mean nothing (random weights).

The draft's real forwards run (its cost is real), then each proposed token of a row is replaced: with probability
alpha by the target's own token at that position (its greedy target-only output, run first as the reference), else
by a token the target does not emit there. Greedy verification then accepts a drafted token with probability alpha
while the ones before it were accepted, so a step of k tokens emits E = (1 - alpha^(k+1)) / (1 - alpha) tokens on
average, what a draft of acceptance alpha gives. The output must equal the reference (lossless), which the run checks,
as it measures the acceptance that held. Used by gpu_step.py; not part of the engine.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dsde_bench.backend import IdTokenizer
from dsde_core.config import EngineConfig, SamplingParams
from dsde_core.engine import Engine
from dsde_core.models.runner import Runner
from dsde_core.policies import make_policy
from dsde_core.policies.stopping import DraftStop
from dsde_core.workers import DraftTask, DraftWorker, Proposal, TargetWorker


class ControlledDraft(DraftWorker):
    """A DraftWorker whose proposals are replaced as the module doc says; `references` maps a prompt to its greedy
    target-only sequence (prompt and output). Every prompt has one length, so a row's prompt is its first tokens."""

    def __init__(self, runner: Runner, config: EngineConfig, alpha: float,
                 references: dict[tuple[int, ...], list[int]], seed: int = 0) -> None:
        super().__init__(runner, config.draft_top_k, config.draft_logit_noise, config.draft_window)
        self.alpha, self.references, self.rng = alpha, references, random.Random(seed)
        (self.prompt_len,) = {len(p) for p in references}

    def propose(self, tasks: list[DraftTask], stop: DraftStop | None = None) -> list[Proposal]:
        out = super().propose(tasks, stop)
        for p in out:
            s = self.slots[p.slot]
            truth = self.references[tuple(s.committed[: self.prompt_len])]
            at = len(s.committed)  # the position of the row's first drafted token
            for j in range(len(p.tokens)):
                x = truth[at + j]
                p.tokens[j] = x if self.rng.random() < self.alpha else (x + 1) % self.runner.vocab_size
        return out


@dataclass
class Run:
    policy: str
    batch: int
    alpha: float | None  # None: target-only
    tokens_per_s: float
    acceptance: float | None  # accepted / drafted over the run
    lossless: bool  # every output equals the reference


def run_engine(target: Runner, draft: Runner | None, config: EngineConfig, policy: str, prompts: Sequence[list[int]],
               max_tokens: int, alpha: float | None = None,
               references: dict[tuple[int, ...], list[int]] | None = None) -> tuple[float, list[list[int]], Any]:
    """One closed batch of greedy requests to the end: (seconds, outputs, the requests)."""
    worker = None if draft is None or alpha is None else ControlledDraft(draft, config, alpha, references or {})
    engine = Engine(TargetWorker(target), worker, make_policy(policy if worker else "off"), IdTokenizer(), config,
                    vocab_size=target.vocab_size)
    reqs = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
    sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    engine.run()
    sync()
    if worker is not None and (draft_health := engine.health["draft"]).failures:  # it went on target-only
        raise RuntimeError(f"the controlled draft failed: {draft_health.last_error}")
    return time.perf_counter() - t0, [r.output_ids for r in reqs], reqs


def speed_table(target: Runner, draft: Runner, config: EngineConfig, batches: Sequence[int],
                policies: Sequence[str], alphas: Sequence[float], prompt_len: int, max_tokens: int,
                out_of_time: Any = lambda: False) -> list[Run]:
    """Target-only and each policy x alpha, at each batch size (closed batches of random prompts), until
    out_of_time() says stop."""
    rows: list[Run] = []
    gen = torch.Generator().manual_seed(0)
    for b in batches:
        if out_of_time():
            break
        prompts = [torch.randint(0, target.vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(b)]
        _, ref, _ = run_engine(target, None, config, "off", prompts, max_tokens)  # the reference; a warm-up too
        references = {tuple(p): p + o for p, o in zip(prompts, ref, strict=True)}
        s, outs, _ = run_engine(target, None, config, "off", prompts, max_tokens)
        rows.append(Run("target-only", b, None, b * max_tokens / s, None, outs == ref))
        for alpha in alphas:
            for policy in policies:
                if out_of_time():
                    return rows
                s, outs, reqs = run_engine(target, draft, config, policy, prompts, max_tokens, alpha, references)
                drafted = sum(r.stats.drafted for r in reqs)
                acceptance = sum(r.stats.accepted for r in reqs) / drafted if drafted else None
                rows.append(Run(policy, b, alpha, b * max_tokens / s, acceptance, outs == ref))
    return rows
