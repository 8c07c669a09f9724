"""dsde-goodput and the online step-cost model: the optimiser against brute force, the policy's switching on
scripted feedback, the cost fit on synthetic timings, and the draft cache staying fresh while speculation is off."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dsde_core.config import SamplingParams
from dsde_core.cost import OnlineCostModel, StepCosts
from dsde_core.errors import ConfigError
from dsde_core.policies import GoodputConfig, GoodputPolicy, Plan, SeqInfo, SpeculationPolicy, StepFeedback, make_policy
from dsde_core.policies.goodput import best_plan, expected_tokens
from dsde_core.workers import DraftTask, DraftWorker
from tests.tiny import random_prompts, tiny_engine

CPU = StepCosts(verify_s=0.08, verify_per_token_s=0.004, draft_fwd_s=0.02, draft_per_token_s=0.001)


def test_expected_tokens_is_the_geometric_sum() -> None:
    e = expected_tokens(np.array([0.5, 0.0, 0.9]), 3)
    assert e[0].tolist() == pytest.approx([1, 1.5, 1.75, 1.875])
    assert e[1].tolist() == pytest.approx([1, 1, 1, 1])
    assert e[2, 3] == pytest.approx(1 + 0.9 + 0.81 + 0.729)


def _goodput(values: np.ndarray, ks: tuple[int, ...], costs: StepCosts) -> float:
    return sum(values[i, k] for i, k in enumerate(ks)) / costs.step_s(ks)


@pytest.mark.parametrize("seed", range(6))
def test_best_plan_finds_the_brute_force_optimum(seed: int) -> None:
    rng = np.random.default_rng(seed)
    b, kmax = 3, 6
    alpha = rng.uniform(0.05, 0.97, b)
    max_k = rng.integers(0, kmax + 1, b)
    costs = StepCosts(verify_s=rng.uniform(0.05, 0.2), verify_per_token_s=rng.uniform(0, 0.01),
                      draft_fwd_s=rng.uniform(0.002, 0.08), draft_per_token_s=rng.uniform(0, 0.003))
    values = expected_tokens(alpha, kmax)
    ks = best_plan(values, max_k, costs, np.zeros(b))
    best = max(_goodput(values, c, costs)
               for c in itertools.product(*(range(m + 1) for m in max_k.tolist())))
    assert _goodput(values, tuple(ks.tolist()), costs) == pytest.approx(best, rel=1e-9)
    assert all(0 <= k <= m for k, m in zip(ks.tolist(), max_k.tolist(), strict=True))


def test_best_plan_switches_off_when_drafting_does_not_pay() -> None:
    values = expected_tokens(np.array([0.1, 0.15]), 8)
    assert best_plan(values, np.array([8, 8]), CPU, np.zeros(2)).tolist() == [0, 0]
    # the same acceptance pays when a draft forward is nearly free (a GPU-like 1B/70B pair)
    gpu = StepCosts(verify_s=0.03, verify_per_token_s=0.0, draft_fwd_s=0.0006, draft_per_token_s=0.0)
    assert all(k > 0 for k in best_plan(values, np.array([8, 8]), gpu, np.zeros(2)).tolist())


def test_one_long_k_is_taken_only_when_the_batch_gains() -> None:
    """The cap as a consequence: a confident sequence does not drag 7 unsure ones into long draft loops."""
    alpha = np.array([0.97] + [0.3] * 7)
    ks = best_plan(expected_tokens(alpha, 20), np.full(8, 20), CPU, np.zeros(8)).tolist()
    alone = best_plan(expected_tokens(alpha[:1], 20), np.array([20]), CPU, np.zeros(1)).tolist()
    assert ks[0] < alone[0]  # the batch shortens the confident sequence's k
    assert max(ks[1:]) <= ks[0]


def _feed(policy: SpeculationPolicy, req: str, plan: Plan, accept_rate: float, kld: float = 0.1) -> StepFeedback:
    k = plan.k
    acc = min(k, int(round(accept_rate * k)))
    fb = StepFeedback(req, k, k, acc, (kld,) * k)
    policy.observe([fb])
    return fb


def test_policy_turns_off_under_rejection_probes_and_comes_back() -> None:
    cfg = GoodputConfig(probe_every=4, probe_max=16)
    pol = GoodputPolicy(cfg)
    seq = [SeqInfo("r", 0.0, 10)]
    ks = []
    for _ in range(40):  # nothing is ever accepted
        [p] = pol.plan(seq, CPU)
        ks.append(p.k)
        _feed(pol, "r", p, 0.0)
    assert ks[0] > 0  # the prior starts speculation
    off_steps = [i for i, k in enumerate(ks) if k == 0]
    assert len(off_steps) >= 30  # then it switches off
    probes = [i for i in range(off_steps[0], 40) if ks[i] > 0]
    assert probes and all(ks[i] == cfg.probe_k for i in probes)  # re-probed now and then
    gaps = np.diff(probes).tolist()
    assert gaps == sorted(gaps) and gaps[-1] <= cfg.probe_max  # with a growing interval
    for _ in range(40):  # now everything is accepted: a probe sees it and speculation comes back
        [p] = pol.plan(seq, CPU)
        _feed(pol, "r", p, 1.0, kld=0.01)
    assert pol.plan(seq, CPU)[0].k >= 4
    assert pol.stats("r")["on"] == 1.0


def test_hysteresis_keeps_a_borderline_sequence_from_flapping() -> None:
    """Acceptance hovering at break-even: the margin keeps switching rare."""
    pol = GoodputPolicy(GoodputConfig(margin=0.2, probe_every=64, probe_max=64))
    seq = [SeqInfo("r", 0.0, 6)]
    rng = np.random.default_rng(0)
    states = []
    for _ in range(200):
        [p] = pol.plan(seq, CPU)
        states.append(p.k > 0)
        if p.k:
            acc = int(sum(rng.random() < 0.3 for _ in range(p.k)))
            pol.observe([StepFeedback("r", p.k, p.k, acc, (0.2,) * p.k)])
    assert sum(a != b for a, b in itertools.pairwise(states)) <= 8


def test_instability_lowers_the_expected_acceptance() -> None:
    pol = GoodputPolicy()
    seq = [SeqInfo("calm", 0.0, 8), SeqInfo("rising", 0.0, 8)]
    for step in range(12):
        plans = pol.plan(seq, CPU)
        for s, p in zip(seq, plans, strict=True):
            k = max(p.k, 1)
            kld = 0.05 + 0.01 * (step % 3)  # calm: small and steady
            if s.req_id == "rising" and step >= 9:
                kld = 2.0 + step  # the KLD jumps at the end
            pol.observe([StepFeedback(s.req_id, k, k, k - 1, (kld,) * k)])
    assert pol.stats("rising")["instability"] > 1.0 > pol.stats("calm")["instability"]
    assert pol.alpha("rising") < pol.alpha("calm")


def test_policy_contract_and_config_errors() -> None:
    pol = make_policy("dsde-goodput")
    assert isinstance(pol, GoodputPolicy) and pol.cost_aware
    plans = pol.plan([SeqInfo("a", 0.0, 0), SeqInfo("b", 1.0, 3)])  # no costs given: the prior's
    assert plans[0].k == 0 and 0 <= plans[1].k <= 3
    pol.observe([StepFeedback("ghost", 1, 1, 1, (0.1,))])  # unknown ids are ignored
    assert pol.num_tracked() == 2
    pol.release("a")
    pol.release("b")
    assert pol.num_tracked() == 0
    with pytest.raises(ConfigError, match="probe_k"):
        GoodputConfig(probe_k=0)
    with pytest.raises(ConfigError, match="prior_alpha"):
        GoodputConfig(prior_alpha=1.0)


def test_online_cost_model_recovers_the_step_costs() -> None:
    rng = np.random.default_rng(1)
    model = OnlineCostModel()
    true_v0, true_v1, true_c, true_d0, true_d1 = 0.150, 0.010, 0.006, 0.045, 0.002
    for _ in range(300):
        b = int(rng.integers(1, 9))
        ks = rng.integers(0, 7, b).tolist()
        verify = true_v0 + true_v1 * b + true_c * sum(ks)
        draft = true_d0 * max(ks) + true_d1 * sum(ks)
        model.observe(ks, draft * rng.uniform(0.98, 1.02), verify * rng.uniform(0.98, 1.02))
    est = model.estimate(4)
    assert est.verify_s == pytest.approx(true_v0 + 4 * true_v1, rel=0.05)
    assert est.verify_per_token_s == pytest.approx(true_c, rel=0.15)
    assert est.draft_fwd_s == pytest.approx(true_d0, rel=0.1)
    assert est.step_s([3, 0, 5, 1]) == pytest.approx(true_v0 + 4 * true_v1 + (true_c + true_d1) * 9 + true_d0 * 5,
                                                     rel=0.05)


def test_online_cost_model_leaves_its_prior_within_tens_of_steps() -> None:
    """The prior is worth CostPrior.weight (4) observations, not hundreds: 40 batch-1 steps on hardware twice as
    slow as the prior already give the costs within 10%."""
    model = OnlineCostModel()
    v, d = 0.16, 0.04  # the prior: 0.084 and 0.021
    for i in range(40):
        k = i % 7
        model.observe([k], d * k, v)
    est = model.estimate(1)
    assert est.verify_s == pytest.approx(v, rel=0.1)
    assert est.draft_fwd_s + est.draft_per_token_s == pytest.approx(d, rel=0.1)


def test_engine_feeds_its_cost_model_from_decode_steps() -> None:
    engine = tiny_engine("static:3", batch=2)
    for p in random_prompts(2, seed=5):
        engine.add_request(p, SamplingParams(max_tokens=12))
    engine.run()
    decode_steps = sum(1 for r in engine.step_log if not r.prefill)
    assert engine.costs.observed == decode_steps > 0
    assert engine.costs.estimate(2).verify_s > 0


class _Toggle(SpeculationPolicy):
    """k = 3, except k = 0 on plan numbers in `off`."""

    def __init__(self, off: range) -> None:
        self.off, self.n = off, 0

    def plan(self, seqs, costs=None):
        self.n += 1
        return [Plan(0 if self.n in self.off else min(3, s.max_k)) for s in seqs]

    def observe(self, feedback):
        pass

    def release(self, req_id):
        pass

    def num_tracked(self):
        return 0


def test_draft_cache_does_not_go_stale_while_speculation_is_off() -> None:
    """Two requests; one stays off for 10 steps while the other drafts, so its tokens ride in the draft forwards.
    The first step after it turns back on proposes exactly what a fresh draft prefilled with the committed tokens
    proposes (the draft a never-off run would hold), so its acceptance is the never-off acceptance; its draft
    cache already held all but the newest committed token (no catch-up work)."""
    engine = tiny_engine(_Toggle(range(3, 13)), batch=2)
    prompts = random_prompts(2, seed=11)
    reqs = [engine.add_request(p, SamplingParams(max_tokens=m)) for p, m in zip(prompts, (40, 150), strict=True)]
    engine.policy = _PerRequestOff(engine.policy, reqs[0].req_id)
    for _ in range(12):
        engine.step()
    draft: DraftWorker = engine.draft
    r = reqs[0]
    slot = draft.slots[r.slot]
    assert r.num_tokens - len(slot.cached) <= 2  # all but the newest one or two committed tokens are cached
    fresh = DraftWorker(type(draft.runner)(draft.runner.model, 1, 256), draft.top_k)
    fresh.open(0, r.params)
    expected = fresh.propose([DraftTask(0, list(r.tokens), 3)])[0].tokens
    before = r.stats.accepted
    engine.step()  # speculation back on for r
    assert r.stats.sl[-1] == 3
    accepted_now = r.stats.accepted - before
    target_next = r.output_ids[-(accepted_now + 1):]
    matches = next((i for i, (a, b) in enumerate(zip(expected, target_next, strict=False)) if a != b), 3)
    assert accepted_now == matches  # the never-off draft's acceptance at this position


class _PerRequestOff(SpeculationPolicy):
    """Applies the inner toggle to one request only; the others always draft k = 3."""

    def __init__(self, inner: _Toggle, req_id: str) -> None:
        self.inner, self.req_id = inner, req_id

    def plan(self, seqs, costs=None):
        toggled = self.inner.plan(seqs, costs)
        return [t if s.req_id == self.req_id else Plan(min(3, s.max_k)) for s, t in zip(seqs, toggled, strict=True)]

    def observe(self, feedback):
        pass

    def release(self, req_id):
        pass

    def num_tracked(self):
        return 0


def test_lone_sequence_catches_up_after_max_lag() -> None:
    """No sequence drafts: the draft cache catches up once it lags draft_max_lag tokens (bounded staleness)."""
    engine = tiny_engine(_Toggle(range(1, 1000)), batch=1, draft_max_lag=8)
    r = engine.add_request(random_prompts(1, seed=2)[0], SamplingParams(max_tokens=30))
    lags = []
    for _ in range(25):
        engine.step()
        if r.slot is not None:
            lags.append(r.num_tokens - len(engine.draft.slots[r.slot].cached))
    assert max(lags) <= 8 + 1 and min(lags) <= 2
