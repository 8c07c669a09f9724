"""dsde-goodput, its stop rule and the online step-cost model: the rule against brute force and on the shapes that
matter (a verify cost that jumps, padded verification), the acceptance model and the policy on scripted feedback,
the cost tables on synthetic timings, the draft worker obeying the rule, and the draft cache staying fresh while
speculation is off."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from dsde_core.config import SamplingParams
from dsde_core.cost import OnlineCostModel, StepCosts
from dsde_core.errors import ConfigError
from dsde_core.policies import GoodputConfig, GoodputPolicy, Plan, SeqInfo, SpeculationPolicy, StepFeedback, make_policy
from dsde_core.policies.goodput import AcceptanceModel, _State
from dsde_core.policies.stopping import CONF_EPS, CONFIDENCE_AS_P, DraftStop, logit, sigmoid
from dsde_core.workers import DraftTask, DraftWorker
from tests.tiny import random_prompts, tiny_engine


def _costs(batch: int = 1, verify=lambda n: 0.14 + 0.0005 * n, draft=lambda n: 0.04 + 0.005 * (n - 1),
           n: int = 400, padded: bool = False) -> StepCosts:
    return StepCosts(batch, tuple(verify(i) for i in range(1, n + 1)), tuple(draft(i) for i in range(1, n + 1)),
                     padded)


def _brute(stop: DraftStop, reach, pbar, room, drafted, lam, fixed=None) -> float:
    """max over (n, h) of the top-n rows' gain over h levels - lam * seconds, by explicit loops."""
    fixed = fixed or [0.0] * len(reach)
    order = sorted(range(len(reach)), key=lambda i: -reach[i] * pbar[i])
    best = -math.inf
    for n in range(1, len(reach) + 1):
        rows = order[:n]
        for h in range(1, max(room[i] for i in rows) + 1):
            gain = sum(reach[i] * sum(pbar[i] ** m for m in range(1, min(h, room[i]) + 1)) for i in rows)
            draft = sum(stop.costs.draft(sum(room[i] >= lv for i in rows)) for lv in range(1, h + 1))
            t0 = stop.verify_base + drafted
            verify = stop.costs.verify(t0 + sum(min(h, room[i]) for i in rows)) - stop.costs.verify(t0)
            once = sum(fixed[i] if np.isscalar(fixed[i]) else fixed[i][min(h, room[i], len(fixed[i])) - 1]
                       for i in rows)  # a per-level cost: at the levels row i drafts
            best = max(best, gain - lam * (draft + verify + once))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_stop_rule_finds_the_brute_force_optimum(seed: int) -> None:
    rng = np.random.default_rng(seed)
    b = int(rng.integers(1, 6))
    jump = int(rng.integers(2, 12))
    costs = _costs(b, verify=lambda n: 0.1 + 0.001 * n + 0.05 * (n > jump))
    stop = DraftStop(costs, b, float(rng.uniform(5, 60)))
    reach, pbar = rng.uniform(0.05, 1, b).tolist(), rng.uniform(0.3, 0.99, b).tolist()
    room, drafted = rng.integers(1, 7, b).tolist(), int(rng.integers(0, 4))
    fixed = rng.uniform(0, 0.05, b).tolist() if seed % 2 else None  # prefill shares
    if seed % 3 == 0:  # ... that grow with the levels drafted (fewer steps left to spread a prefill over)
        fixed = [np.cumsum(rng.uniform(0, 0.01, int(r))).tolist() for r in room]
    n, net, gain, seconds = stop.best(reach, pbar, room, drafted, stop.goodput, fixed=fixed)
    assert net == pytest.approx(_brute(stop, reach, pbar, room, drafted, stop.goodput, fixed), abs=1e-12)
    assert net == pytest.approx(gain - stop.goodput * seconds)
    go = stop.next_level(reach, pbar, room, drafted, fixed=fixed)
    assert sum(go) == (n if net > 0 else 0)
    if net > 0:  # the rows that go on are the best ones by reach * pbar
        kept = [reach[i] * pbar[i] for i in range(b) if go[i]]
        dropped = [reach[i] * pbar[i] for i in range(b) if not go[i]]
        assert min(kept) >= max(dropped, default=0.0)


def test_stop_rule_drafts_while_confident_and_stops_after_doubt() -> None:
    stop = DraftStop(_costs(), 1, 12.0)
    model = CONFIDENCE_AS_P
    reach, drafted = 1.0, 0
    for c in (0.99, 0.98, 0.99, 0.97):
        reach *= stop.accept_prob(c, model)
        drafted += 1
        assert stop.next_level([reach], [0.95], [10], drafted) == [True]
    reach *= stop.accept_prob(0.2, model)  # the draft is unsure of this token: the next ones are not worth it
    assert stop.next_level([reach], [0.95], [10], drafted + 1) == [False]


def test_stop_rule_looks_past_a_jump_in_the_verify_cost() -> None:
    """A CPU GEMM's cost steps up at 17 query tokens: one token across the step does not pay for it, a long confident
    run beyond it does (lookahead h > 1); a run that soon ends is cut at the step."""
    stop = DraftStop(_costs(verify=lambda n: 0.14 + 0.05 * (n > 16), draft=lambda n: 0.02), 1, 15.0)
    assert stop.next_level([0.98], [0.995], [20], drafted=15) == [True]  # 16 verified; 20 more good tokens ahead
    assert stop.next_level([0.98], [0.995], [1], drafted=15) == [False]  # only one more token may be drafted
    assert stop.next_level([0.98], [0.6], [20], drafted=15) == [False]  # a short expected run: not worth the jump
    assert stop.next_level([0.98], [0.6], [20], drafted=10) == [True]  # well before the step it goes on


def test_padded_verification_moves_the_whole_batch() -> None:
    """vLLM-style padding: every sequence is verified to the longest draft, so rows never stop alone."""
    stop = DraftStop(_costs(batch=4, verify=lambda n: 0.03, draft=lambda n: 0.0015, padded=True), 4, 400.0)
    assert stop.next_level([0.9, 0.8, 0.1, 0.05], [0.9] * 4, [5] * 4, drafted=8, level=2) == [True] * 4
    assert stop.next_level([0.05] * 4, [0.5] * 4, [5] * 4, drafted=8, level=2) == [False] * 4


def test_step_goodput_is_the_best_ratio_the_model_sees() -> None:
    costs = _costs()
    stop = DraftStop(costs, 1, 7.0)
    lam = stop.step_goodput([1.0], [0.95], [20], rows=1)
    # the best blind run: (1 + sum_{m<=h} 0.95^m) / (V(1 + h) + h D) over h, found by Dinkelbach
    exact = max((1 + sum(0.95 ** m for m in range(1, h + 1))) / (costs.verify(1 + h) + sum(costs.draft(1)
                for _ in range(h))) for h in range(1, 21))
    assert lam == pytest.approx(exact, rel=1e-6)
    assert stop.step_goodput([1.0], [0.05], [20], rows=1) == 7.0  # nothing pays: no change


def test_acceptance_model_learns_the_calibration() -> None:
    rng = np.random.default_rng(0)
    true_a, true_s, true_u = -1.0, 2.0, -0.8
    model = AcceptanceModel((0.7, 0.9, 0.0), 1.0, 1.0)
    for _ in range(4000):
        c, x = float(rng.uniform(0.05, 0.999)), float(rng.uniform(0, 2))
        model.update(c, x, bool(rng.random() < sigmoid(true_a + true_s * logit(c) + true_u * x)))
    assert model.w == pytest.approx([true_a, true_s, true_u], abs=0.25)
    a, s, floor = model.row_model(1.0)
    assert a == pytest.approx(model.w[0] + model.w[2]) and s == model.w[1] and floor == CONF_EPS


def _feed(policy: GoodputPolicy, plans: list[Plan], seqs: list[SeqInfo], accept, conf: float = 0.9) -> None:
    fbs = []
    for seq, plan in zip(seqs, plans, strict=True):
        k = plan.k
        acc = accept(k) if k else 0
        fbs.append(StepFeedback(seq.req_id, k, k, acc, (0.1,) * k, (), (conf,) * k))
    policy.observe(fbs)


CPU = _costs()


def test_policy_switches_off_probes_on_a_shared_schedule_and_comes_back() -> None:
    cfg = GoodputConfig(probe_every=4, probe_max=16, explore_steps=4)  # the lone sequence is the pool's evidence
    pol = GoodputPolicy(cfg)
    seqs = [SeqInfo("r", 0.0, 10)]
    ks = []
    for _ in range(60):  # nothing is ever accepted, though the draft is confident
        plans = pol.plan(seqs, CPU)
        ks.append(plans[0].k)
        _feed(pol, plans, seqs, lambda k: 0, conf=0.2)
    assert ks[0] > 0  # the prior starts speculation
    off = [i for i, k in enumerate(ks) if k == 0]
    assert len(off) >= 50  # then it switches off
    probes = [i for i in range(off[0], 60) if ks[i] > 0]
    assert probes and all((i + 1) % cfg.probe_every == 0 for i in probes)  # on plan numbers divisible by 4
    gaps = np.diff(probes).tolist()  # a growing interval (a probe waits for the next plan number it divides)
    assert gaps == sorted(gaps) and gaps[0] >= cfg.probe_every and gaps[-1] < 2 * cfg.probe_max
    for _ in range(40):  # now everything is accepted: a probe sees it and speculation comes back
        plans = pol.plan(seqs, CPU)
        _feed(pol, plans, seqs, lambda k: k, conf=0.99)
    plans = pol.plan(seqs, CPU)
    assert plans[0].k == 10 and plans[0].stop is not None and plans[0].p_next > 0.9
    assert pol.stats("r")["on"] == 1.0


def test_a_new_sequence_starts_from_what_the_earlier_drafts_saw() -> None:
    """The pooled means a new sequence starts from follow every sequence's outcomes: after requests whose drafts
    were all rejected, the next one does not draft its first step (a weak draft costs each new request nothing)."""
    pol = GoodputPolicy()
    drafted = []
    for r in range(6):
        seqs = [SeqInfo(f"a{r}", 0.0, 8)]
        ks = []
        for _ in range(12):
            plans = pol.plan(seqs, CPU)
            ks.append(plans[0].k)
            _feed(pol, plans, seqs, lambda k: 0, conf=0.3)
        pol.release(f"a{r}")
        drafted.append(sum(k > 0 for k in ks))
    assert drafted[0] > 0 and drafted[-1] < drafted[0]  # the prior drafts, the outcomes stop it sooner
    plans = pol.plan([SeqInfo("b", 0.0, 8)], CPU)
    assert plans[0].k == 0 and pol.stats("b")["p_first"] < 0.5


def _taught_nothing_is_accepted(cfg: GoodputConfig) -> GoodputPolicy:
    """A policy whose pool has seen 30 earlier requests of 4 drafting steps each, none of whose tokens was accepted."""
    pol = GoodputPolicy(cfg)
    for r in range(30):
        old = [SeqInfo(f"a{r}", 0.0, 8)]
        for _ in range(4):
            plans = pol.plan(old, CPU)
            _feed(pol, plans, old, lambda k: 0, conf=0.2)
        pol.release(f"a{r}")
    return pol


def test_a_sequence_with_a_cold_draft_cache_waits_longest_for_its_first_probe() -> None:
    """Where the pooled evidence says drafting does not pay, a new sequence starts off. If its draft cache is empty
    (the engine says so: draft_lag > 0), its first probe would also prefill the draft with its whole context: that
    probe comes only after probe_max plans, and only if it has probe_max tokens left. A sequence whose draft cache is
    warm probes after probe_every plans."""
    cfg = GoodputConfig(probe_every=4, probe_max=16)
    pol = _taught_nothing_is_accepted(cfg)

    def first_probe(seq: SeqInfo) -> int:
        ks = []
        for _ in range(40):
            plans = pol.plan([seq], CPU)
            ks.append(plans[0].k)
            _feed(pol, plans, [seq], lambda k: 0, conf=0.2)
        pol.release(seq.req_id)
        assert ks[0] == 0
        return next(i for i, k in enumerate(ks) if k > 0)

    assert first_probe(SeqInfo("cold", 0.0, 8, draft_lag=100)) >= cfg.probe_max - 1
    assert first_probe(SeqInfo("warm", 0.0, 8, draft_lag=0)) < cfg.probe_max - 1
    # with fewer tokens left than probe_max once its probe is due, the prefill would not pay back: no probe at all
    ks = []
    for left in range(30, 0, -1):
        short = [SeqInfo("c", 0.0, min(8, left - 1), remaining=left, draft_lag=100)]
        plans = pol.plan(short, CPU)
        ks.append(plans[0].k)
        _feed(pol, plans, short, lambda k: 0, conf=0.2)
    assert ks == [0] * 30


def test_a_cold_sequence_whose_draft_cache_fills_while_off_probes_as_a_warm_one() -> None:
    """A draft prefill fed in chunks can finish while the sequence is off (its chunks ride along with the batch's draft
    work): from then on there is no prefill to recoup, and it probes after probe_every plans, not probe_max."""
    cfg = GoodputConfig(probe_every=4, probe_max=16)
    pol = _taught_nothing_is_accepted(cfg)
    ks = []
    for i in range(cfg.probe_max):
        seq = [SeqInfo("filled", 0.0, 8, draft_lag=100 if i < 2 else 0)]  # its draft cache is full from plan 2 on
        plans = pol.plan(seq, CPU)
        ks.append(plans[0].k)
        _feed(pol, plans, seq, lambda k: 0, conf=0.2)
    assert ks[0] == 0 and any(ks[: cfg.probe_max - 2])
    # one whose own probe filled its draft cache keeps the doubled interval: its probes stay probe_max plans apart
    ks, lag = [], 100
    for _ in range(4 * cfg.probe_max):
        seq = [SeqInfo("probed", 0.0, 8, draft_lag=lag)]
        plans = pol.plan(seq, CPU)
        ks.append(plans[0].k)
        lag = 0 if plans[0].k else lag
        _feed(pol, plans, seq, lambda k: 0, conf=0.2)
    probes = [i for i, k in enumerate(ks) if k]
    assert len(probes) >= 2 and probes[0] >= cfg.probe_max - 1
    assert all(b - a >= cfg.probe_max for a, b in zip(probes, probes[1:], strict=False))


def test_a_probe_whose_draft_prefill_is_chunked_goes_on_until_it_drafts() -> None:
    """The engine feeds a long draft prefill in chunks (EngineConfig.prefill_chunk): a probe of a cold sequence then
    proposes nothing for a few steps. The probe goes on, plan after plan, until the sequence has drafted once; then it
    is off again, and its next probe comes probe_max plans after the first began (the interval doubled once)."""
    cfg = GoodputConfig(probe_every=4, probe_max=16)
    pol = _taught_nothing_is_accepted(cfg)
    ks, lag, chunk = [], 100, 40  # the draft takes in 40 context tokens a step; the rest, then drafts, once it fits
    for _ in range(4 * cfg.probe_max):
        seq = [SeqInfo("chunked", 0.0, 8, draft_lag=lag)]
        plans = pol.plan(seq, CPU)
        k = plans[0].k
        ks.append(k)
        if k and lag > chunk:  # a chunk: cached, nothing proposed
            lag -= chunk
            pol.observe([StepFeedback("chunked", k, 0, 0)])
        else:
            lag = 0 if k else lag
            _feed(pol, plans, seq, lambda k: 0, conf=0.2)
    first = next(i for i, k in enumerate(ks) if k)
    assert ks[first: first + 4] == [8, 8, 8, 0]  # two chunks, then the rest and a draft; then off
    probes = [i for i, k in enumerate(ks) if k and not ks[i - 1]]
    assert len(probes) >= 3 and all(ks[i + 1] == 0 for i in probes[1:])  # warm now: one plan each
    assert all(b - a == cfg.probe_max for a, b in zip(probes, probes[1:], strict=False))


def test_where_nothing_drafts_for_long_the_longest_row_probes_the_pool() -> None:
    """The all-off trap: every row off and every request too short for its cold probe, so nothing would time or
    judge the draft again. Every pool_probe_every plans without a drafting row, the row with the most tokens left
    drafts once. (A warm row that is off probes on its own within probe_max plans.) Here the probes do not back off
    (probe_backoff 1); the next test backs off."""
    cfg = GoodputConfig(probe_every=4, probe_max=16, pool_probe_every=24, probe_backoff=1)
    pol = _taught_nothing_is_accepted(cfg)
    seqs = [SeqInfo("short", 0.0, 8, remaining=10, draft_lag=2), SeqInfo("long", 0.0, 8, remaining=14,
                                                                          draft_lag=2)]
    ks = []
    for _ in range(100):
        plans = pol.plan(seqs, CPU)
        ks.append([p.k for p in plans])
        _feed(pol, plans, seqs, lambda k: 0, conf=0.2)
    probes = [i for i, k in enumerate(ks) if any(k)]
    assert len(probes) >= 3 and np.diff(probes).tolist() == [cfg.pool_probe_every] * (len(probes) - 1)
    assert all(ks[i] == [0, 8] for i in probes)  # the row with the most tokens left, alone
    assert pol.plan(seqs, CPU)[1].stop is None  # (between probes nothing drafts)
    with pytest.raises(ConfigError, match="pool_probe_every"):
        GoodputConfig(pool_probe_every=0)


def test_probes_that_pay_a_prefill_and_find_no_gain_wait_ever_longer() -> None:
    """Each pool probe that the rule does not follow doubles the wait before the next, up to probe_backoff times
    pool_probe_every: where no draft pays, what the probes cost shrinks instead of staying a prefill every
    pool_probe_every plans."""
    cfg = GoodputConfig(probe_every=4, probe_max=16, pool_probe_every=24, probe_backoff=4)
    pol = _taught_nothing_is_accepted(cfg)
    seqs = [SeqInfo("short", 0.0, 8, remaining=10, draft_lag=2), SeqInfo("long", 0.0, 8, remaining=14,
                                                                          draft_lag=2)]
    ks = []
    for _ in range(500):
        plans = pol.plan(seqs, CPU)
        ks.append([p.k for p in plans])
        _feed(pol, plans, seqs, lambda k: 0, conf=0.2)
    probes = [i for i, k in enumerate(ks) if any(k)]
    assert np.diff(probes).tolist()[:4] == [48, 96, 96, 96]  # 24 x 2, then x 4 = probe_backoff, and no further
    with pytest.raises(ConfigError, match="probe_backoff"):
        GoodputConfig(probe_backoff=0)


def test_a_probe_pays_a_draft_prefill_only_within_its_budget() -> None:
    """A cold or pool probe prefills the draft with the row's whole context: it goes ahead only where that prefill,
    C * lag (here 0.005 s a token), is at most probe_budget of the row's remaining tokens at target-only speed,
    remaining * V(B) (0.14 s a step)."""
    cfg = GoodputConfig(probe_every=4, probe_max=16, pool_probe_every=24, probe_backoff=1)

    def probes(seqs: list[SeqInfo], plans: int = 200) -> list[list[int]]:
        pol, ks = _taught_nothing_is_accepted(cfg), []
        for _ in range(plans):
            out = pol.plan(seqs, CPU)
            ks.append([p.k for p in out])
            _feed(pol, out, seqs, lambda k: 0, conf=0.2)
        return [k for k in ks if any(k)]

    # 100 tokens of prefill (0.5 s) against 10 or 14 tokens left (2% of them: 0.03-0.04 s): no probe at all
    trap = [SeqInfo("a", 0.0, 8, remaining=10, draft_lag=100), SeqInfo("b", 0.0, 8, remaining=14, draft_lag=100)]
    assert probes(trap) == []
    # the pool probe takes the row that affords it, though another has more tokens left
    assert probes([*trap, SeqInfo("c", 0.0, 8, remaining=8, draft_lag=1)]) == [[0, 0, 8]] * 8
    # a cold row's own probe: 0.5 s affordable over 400 tokens (1.1 s), not over 100 (0.28 s)
    assert probes([SeqInfo("d", 0.0, 8, remaining=100, draft_lag=100)]) == []
    assert len(probes([SeqInfo("e", 0.0, 8, remaining=400, draft_lag=100)])) >= 4
    with pytest.raises(ConfigError, match="probe_budget"):
        GoodputConfig(probe_budget=0.0)


def _with_evidence(costs: StepCosts) -> GoodputPolicy:
    """A policy whose pool has seen 8 drafting steps of an earlier request, and explores no more: its first token
    was accepted every other step (the pool's priors then weigh half)."""
    pol, seqs = GoodputPolicy(GoodputConfig(explore_steps=8)), [SeqInfo("earlier", 0.0, 8)]
    for step in range(8):
        plans = pol.plan(seqs, costs)
        assert plans[0].k > 0
        _feed(pol, plans, seqs, lambda k, step=step: (4, 0, 2, 0)[step % 4], conf=0.7)
    pol.release("earlier")
    return pol


def test_a_draft_prefill_is_weighed_against_the_tokens_left() -> None:
    """A sequence whose draft cache is empty pays its context's prefill once it drafts: it drafts with many tokens
    left to spread that over, not with a few (a sequence whose draft is in step drafts either way)."""
    costs = StepCosts(1, CPU.verify_table, CPU.draft_table, context_per_token_s=0.001)
    assert costs.draft_context(500) == pytest.approx(0.5) and costs.draft_context(0) == 0.0

    def first_k(lag: int, remaining: int) -> int:
        return _with_evidence(costs).plan([SeqInfo("a", 0.0, 8, remaining=remaining, draft_lag=lag)], costs)[0].k

    assert first_k(lag=500, remaining=1000) == 8 and first_k(lag=0, remaining=20) == 8
    # 0.5 s of prefill is 3.5 target steps: here (p_first 0.57, pbar 0.69) it pays from ~20 tokens left
    assert first_k(lag=500, remaining=12) == 0 and first_k(lag=500, remaining=30) == 8
    # without a context rate the draft table's slope prices it
    assert CPU.draft_context(10) == pytest.approx(CPU.draft(11) - CPU.draft(1))


def test_new_requests_whose_drafts_pay_draft_from_their_first_plan() -> None:
    """Behind a draft that earlier requests found good, a batch of new requests (empty draft caches) drafts from its
    first plan, the prompt step included: whether a row drafts is judged on the whole request, its prefill's share
    at the step's own goodput. Against the rate warm drafting reached (rho_B B / V(B)), which weighs the share about
    (1 + e) times, they waited while rho_B decayed. Where the prefill does not pay over the tokens left, they stay
    off."""
    costs = StepCosts(4, CPU.verify_table, CPU.draft_table, context_per_token_s=0.001)
    pol = GoodputPolicy()
    for r in range(3):  # earlier requests: every drafted token accepted
        old = [SeqInfo(f"old{r}.{i}", 0.0, 8, remaining=48) for i in range(4)]
        for _ in range(6):
            plans = pol.plan(old, costs)
            assert all(p.k > 0 for p in plans)
            _feed(pol, plans, old, lambda k: k, conf=0.95)
        for s in old:
            pol.release(s.req_id)
    assert pol._speedup.get(4) > 2.0  # the rate warm drafting reached, against target-only's

    def first_ks(tag: str, remaining: int, pending: int = 1) -> list[int]:
        new = [SeqInfo(f"{tag}{i}", 0.0, 8, pending=pending, remaining=remaining, draft_lag=150) for i in range(4)]
        ks = [p.k for p in pol.plan(new, costs)]
        for s in new:
            pol.release(s.req_id)
        return ks

    assert first_ks("prompt", remaining=48, pending=150) == [8] * 4  # 0.15 s of prefill each: it pays over 48
    assert first_ks("decode", remaining=47) == [8] * 4
    assert first_ks("short", remaining=4) == [0] * 4  # ... not over 4


def test_an_empty_pool_explores_with_every_row() -> None:
    """Before any sequence has drafted, the pool holds only its priors, and a plan where no row pays its prefill
    would never draft, so never learn. Then every row drafts (requests differ more than one request's steps do);
    once the pool holds explore_steps drafting steps, rows that do not pay stay off."""
    cfg = GoodputConfig(probe_every=64, probe_max=64)
    costs = StepCosts(4, CPU.verify_table, CPU.draft_table, context_per_token_s=0.001)
    pol, lags, drafting = GoodputPolicy(cfg), [500, 300, 400, 600], []
    n = cfg.explore_steps
    for _ in range(n + 6):  # nothing is accepted
        seqs = [SeqInfo(f"r{i}", 0.0, 8, remaining=20, draft_lag=lag) for i, lag in enumerate(lags)]
        plans = pol.plan(seqs, costs)
        drafting.append([i for i, p in enumerate(plans) if p.k > 0])
        _feed(pol, plans, seqs, lambda k: 0, conf=0.5)
        lags = [0 if p.k > 0 else lag for p, lag in zip(plans, lags, strict=True)]  # a row that drafted is in step
    assert drafting[:n // 4] == [[0, 1, 2, 3]] * (n // 4) and drafting[n // 4:] == [[]] * (n - n // 4 + 6)


def test_a_closed_batch_weighs_each_rows_tokens_by_its_remaining_steps() -> None:
    """With requests waiting every token is worth the same (w = 1); in a closed batch (it came to an idle engine, or
    shrank) a row's tokens are worth its share of the batch's expected remaining steps, B * S_i / sum_j S_j with
    S_i = remaining_i / (1 + e_i(h_i))."""
    cheap = _costs(batch=3, draft=lambda n: 0.005)  # every row drafts
    seqs = [SeqInfo("long", 0.0, 8, remaining=60), SeqInfo("short", 0.0, 8, remaining=12),
            SeqInfo("mid", 0.0, 8, remaining=36)]
    assert [p.worth for p in GoodputPolicy().plan(seqs, cheap, waiting=2)] == [1.0, 1.0, 1.0]
    plans = GoodputPolicy().plan(seqs, cheap, waiting=0)
    assert all(p.k == 8 for p in plans)  # equal states, so S_i is proportional to remaining_i
    assert [p.worth for p in plans] == pytest.approx([60 / 36, 12 / 36, 1.0])


def test_a_rows_remaining_steps_count_the_tokens_it_drafts_not_its_ceiling() -> None:
    """e_i is taken at h_i, the row's mean drafted tokens per drafting step (its running count), not at its ceiling
    k: a row whose pbar is high but whose drafts the stop rule ends after a token or two does not finish early."""
    seqs = [SeqInfo("sure", 0.0, 20, remaining=40), SeqInfo("unsure", 0.0, 20, remaining=40)]
    sure = _State(True, 0.0, p_first=0.85, p_sum=0.85 * 1.4, p_count=1.4)  # pbar 0.85, 1.4 tokens a step
    unsure = _State(True, 0.0, p_first=0.7, p_sum=0.7 * 1.4, p_count=1.4)
    w = GoodputPolicy._worth(seqs, [sure, unsure], [20, 20])  # h = 1 for both: e = p_first
    assert w == pytest.approx([2 * 40 / 1.85 / (40 / 1.85 + 40 / 1.7), 2 * 40 / 1.7 / (40 / 1.85 + 40 / 1.7)])
    assert 0.95 < w[0] < 1.0  # taken at the ceilings (e = 5.45 against 2.33) it would be 0.68: the row left out
    steady = _State(True, 0.0, p_first=0.85, p_sum=0.85 * 3.0, p_count=3.0)  # 3 tokens a step
    e = 0.85 * (1 + 0.85 + 0.85 ** 2)
    w = GoodputPolicy._worth(seqs, [steady, unsure], [20, 20])
    assert w[0] == pytest.approx(2 * (40 / (1 + e)) / (40 / (1 + e) + 40 / 1.7))
    assert GoodputPolicy._worth(seqs, [steady, unsure], [2, 20])[0] == pytest.approx(
        2 * (40 / 2.5725) / (40 / 2.5725 + 40 / 1.7))  # h is at most the row's k (here 2: e = 0.85 * 1.85)


def test_a_batch_whose_freed_slots_are_refilled_weighs_every_token_the_same() -> None:
    """A client that keeps N requests in flight leaves the engine's queue empty at every plan, yet its batch never
    shrinks: once a request joins running ones (it took a freed slot, or a free one) the batch is open, w = 1; a
    departure nothing replaces closes it again, and so does a batch of new requests only."""
    cheap = _costs(batch=3, draft=lambda n: 0.005)
    pol = GoodputPolicy()

    def worth(*rows: tuple[str, int]) -> list[float]:
        return [p.worth for p in pol.plan([SeqInfo(r, 0.0, 8, remaining=n) for r, n in rows], cheap)]

    assert worth(("a", 60), ("b", 12), ("c", 36)) != [1.0] * 3  # a batch came to an idle engine: closed
    assert pol.batch_open is False  # what the last plan read (benchmarks/goodput_plans.py prints it)
    pol.release("b")
    assert worth(("a", 59), ("c", 35), ("d", 48)) == [1.0] * 3  # d took b's slot
    assert worth(("a", 58), ("c", 34), ("d", 47)) == [1.0] * 3  # and it stays open
    assert pol.batch_open is True
    pol.release("c")
    assert worth(("a", 57), ("d", 46)) == pytest.approx([2 * 57 / 103, 2 * 46 / 103])  # c's slot stayed empty
    assert pol.batch_open is False
    assert worth(("a", 56), ("d", 45), ("e", 48)) == [1.0] * 3  # e joined running ones
    pol.release("a")
    pol.release("d")
    pol.release("e")
    assert worth(("f", 30), ("g", 10)) == pytest.approx([1.5, 0.5])  # a new batch, as after an idle engine: closed


def test_in_a_closed_batch_the_row_about_to_finish_stops_drafting() -> None:
    """With requests waiting, both rows' tokens pay for their share of the draft and verify work. With none, the
    batch ends when the long row does, which the short row's drafting does not move: it stays off, the long row
    drafts."""
    costs = _costs(batch=2, draft=lambda n: 0.04 + 0.005 * (n - 1))
    seqs = [SeqInfo("long", 0.0, 8, remaining=48), SeqInfo("short", 0.0, 8, remaining=4)]
    assert [p.k for p in _with_evidence(costs).plan(seqs, costs, waiting=1)] == [8, 8]
    assert [p.k for p in _with_evidence(costs).plan(seqs, costs, waiting=0)] == [8, 0]


def test_a_row_ending_with_this_step_leaves_the_batch_worth_to_the_rows_that_outlast_it() -> None:
    """A row with one token left ends with this step whatever is drafted: S = 0, and the rows that go on share the
    batch's worth B. A row with two tokens left beside it weighs 2 and decides as it would alone at batch 1 (as a mean
    over both rows it weighed 1.1 and left undrafted the token that would have saved the closed batch's last step)."""
    seqs = [SeqInfo("ending", 0.0, 0, remaining=1), SeqInfo("last", 0.0, 1, remaining=2)]
    assert _with_evidence(_costs(batch=2)).plan(seqs, _costs(batch=2))[1].worth == 2.0  # (the ending row cannot draft)
    three = [*seqs, SeqInfo("other", 0.0, 1, remaining=2)]
    assert [p.worth for p in _with_evidence(_costs(batch=3)).plan(three, _costs(batch=3))[1:]] == [1.5, 1.5]
    drafts = []
    for base in np.linspace(0.01, 0.2, 20):
        def draft(n: int, base: float = base) -> float:
            return base + 0.005 * (n - 1)
        beside = _with_evidence(_costs(batch=2, draft=draft)).plan(seqs, _costs(batch=2, draft=draft))[1].k
        alone = _with_evidence(_costs(batch=1, draft=draft)).plan(seqs[1:], _costs(batch=1, draft=draft))[0].k
        assert beside == alone, base
        drafts.append(alone)
    assert 0 in drafts and 1 in drafts  # the cheap drafts pay, the dear ones do not


def test_plans_carry_the_batch_rule_and_each_rows_model() -> None:
    pol = GoodputPolicy()
    seqs = [SeqInfo("a", 0.0, 6), SeqInfo("b", 1.0, 6, pending=40), SeqInfo("c", 0.0, 0)]
    plans = pol.plan(seqs, _costs(batch=3, draft=lambda n: 0.005))  # a cheap draft: both rows draft
    assert plans[2] == Plan(0)  # no room: nothing to draft
    assert plans[0].stop is plans[1].stop and plans[0].stop.verify_base == 1 + 40 + 1
    assert [p.accept_model for p in plans[:2]] == [(0.7, 0.9, CONF_EPS), (0.7, 0.9, 0.1)]  # the prior, both models
    assert all(p.k == 6 for p in plans[:2])
    pol.observe([StepFeedback("b", 6, 3, 0, (0.1,) * 3, (), (0.3,) * 3)])
    assert pol._models[False].judged == 1 and pol._models[True].judged == 0  # sampled and greedy learn apart


def test_instability_enters_the_acceptance_model() -> None:
    """A sequence whose KLD history is rising (DSDE's WVIR * SF > 1) and is then rejected teaches w2 < 0."""
    pol = GoodputPolicy()
    seqs = [SeqInfo("calm", 0.0, 8), SeqInfo("rising", 0.0, 8)]
    for step in range(40):
        plans = pol.plan(seqs, CPU)
        fbs = []
        for s, p in zip(seqs, plans, strict=True):
            k = max(p.k, 4)
            kld = 0.05 + 0.01 * (step % 3) if s.req_id == "calm" or step < 12 else 1.0 + step % 5
            acc = k if s.req_id == "calm" or step < 12 else 0
            fbs.append(StepFeedback(s.req_id, k, k, acc, (kld,) * k, (), (0.9,) * k))
        pol.observe(fbs)
    assert pol.stats("rising")["instability"] > 1.0 > pol.stats("calm")["instability"]
    assert pol.stats("rising")["w_instability"] < 0
    a_rising = pol._models[True].row_model(pol._states["rising"].x)[0]
    a_calm = pol._models[True].row_model(pol._states["calm"].x)[0]
    assert a_rising < a_calm


def test_a_sampled_token_the_draft_thought_unlikely_is_not_judged_unlikely() -> None:
    """At T > 0 a drafted token x is accepted with probability min(1, p(x) / q(x)), and a small q(x) does not make
    that smaller: measured on chat at T = 1, acceptance is ~0.5 below q = 0.2 and rises above it. Fitted on such
    data with no floor, the model says 0.29 at q = 0.001, so one unlikely draw ends the draft; with the floor it
    says what is true at both ends."""
    rng = np.random.default_rng(0)

    def truth(c: float) -> float:
        return 0.5 if c < 0.2 else 0.6 + 0.4 * c

    floored, plain = AcceptanceModel((0.7, 0.9, 0.0), 1.0, 1.0, 0.1), AcceptanceModel((0.7, 0.9, 0.0), 1.0, 1.0)
    for _ in range(3000):
        c = float(10 ** rng.uniform(-3, 0)) if rng.random() < 0.4 else float(rng.uniform(0.2, 1))
        y = bool(rng.random() < truth(c))
        floored.update(c, 0.0, y)
        plain.update(c, 0.0, y)
    for c in (0.001, 0.9):
        assert DraftStop.accept_prob(c, floored.row_model(0.0)) == pytest.approx(truth(c), abs=0.05)
    assert DraftStop.accept_prob(0.001, plain.row_model(0.0)) < truth(0.001) - 0.15
    pol = GoodputPolicy()  # the floor applies to sampled requests only: a greedy draft's argmax is seldom that unsure
    assert [pol._models[g].floor for g in (True, False)] == [CONF_EPS, pol.config.sampled_floor]


def test_pbar_is_a_mean_by_token_not_by_step() -> None:
    """The stop rule ends a step after a doubtful token, so the short steps hold the doubtful tokens: a mean by step
    counts the lone token of such a step as much as the four of a confident one, and reads pbar low (on chat at T = 1:
    0.69 by step, 0.75 by token, 0.76 accepted)."""
    pol = GoodputPolicy(GoodputConfig(prior_variance=1e-9))  # the acceptance model stays at its prior
    seqs = [SeqInfo("r", 1.0, 8)]
    row = pol._models[False].row_model(0.0)
    p_lo, p_hi = DraftStop.accept_prob(0.2, row), DraftStop.accept_prob(0.95, row)
    for step in range(60):  # a step of one doubtful token, then a step of four confident ones
        conf = (0.2,) if step % 2 == 0 else (0.95,) * 4
        pol.plan(seqs, CPU)
        pol.observe([StepFeedback("r", 8, len(conf), len(conf), (0.1,) * len(conf), (), conf)])
    by_token, by_step = (p_lo + 4 * p_hi) / 5, (p_lo + p_hi) / 2
    assert pol.stats("r")["pbar"] == pytest.approx(by_token, abs=0.02) and by_token > by_step + 0.1


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
    with pytest.raises(ConfigError, match="probe_every"):
        GoodputConfig(probe_every=0)
    with pytest.raises(ConfigError, match="prior_pbar"):
        GoodputConfig(prior_pbar=1.0)
    with pytest.raises(ConfigError, match="start_weight must be > 0"):
        GoodputConfig(start_weight=0.0)
    with pytest.raises(ConfigError, match="explore_steps must be >= 0"):
        GoodputConfig(explore_steps=-1)
    with pytest.raises(ConfigError, match="sampled_floor must be in"):
        GoodputConfig(sampled_floor=0.5)
    with pytest.raises(ValueError, match="p_next"):
        Plan(3, p_next=1.5)
    with pytest.raises(ValueError, match="worth"):
        Plan(3, worth=-1.0)


def test_online_cost_model_learns_a_verify_cost_that_jumps() -> None:
    """Target forwards flat to 16 query tokens, then 45 ms dearer: the table holds the jump, never decreases, and
    prices an n it has not seen from the nearest n seen below it."""
    model = OnlineCostModel()
    v = {n: 0.14 + 0.045 * (n > 16) for n in range(1, 40)}
    rng = np.random.default_rng(1)
    for _ in range(300):
        n = int(rng.choice([1, 2, 4, 8, 16, 17, 20, 32]))
        model.observe(n, v[n] * rng.uniform(0.99, 1.01), 0, 0, 0.0)
    est = model.estimate(1, 40)
    assert est.verify(16) == pytest.approx(0.14, rel=0.02) and est.verify(17) == pytest.approx(0.185, rel=0.02)
    assert all(b >= a for a, b in itertools.pairwise(est.verify_table))
    assert est.verify(12) == pytest.approx(0.14, rel=0.02)  # between the 8 and the 16 seen
    assert est.verify(18) < 0.185 and est.verify(40) > est.verify(32)  # optimistic past the jump; prior slope


def test_online_cost_model_shrugs_off_a_burst_and_a_lone_slow_step() -> None:
    """What a shared CPU does (measured, mixed workload at batch 4): bursts of steps taking 2.4x their median, and one
    slow forward at an n seen once. A running mean put V(4) 16% high and a running maximum carried the lone step to
    every n above it, so drafts looked 80 ms dearer than they were; medians and an isotonic fit keep both out."""
    model = OnlineCostModel()
    v = {4: 0.148, 8: 0.155, 12: 0.165, 16: 0.168}
    rng = np.random.default_rng(3)
    for i in range(60):
        for n, t in v.items():
            model.observe(n, t * rng.uniform(0.98, 1.02) * (2.4 if i % 20 in (7, 8, 9) else 1.0), 0, 0, 0.0)
    model.observe(7, 0.235, 0, 0, 0.0)  # once
    est = model.estimate(4, 20)
    for n, t in v.items():
        assert est.verify(n) == pytest.approx(t, rel=0.03)
    assert v[4] <= est.verify(7) <= v[8] * 1.03 and est.verify(12) - est.verify(4) < 0.025
    assert all(b >= a for a, b in itertools.pairwise(est.verify_table))


def _context_steps(model: OnlineCostModel, gamma: float) -> None:
    """What chat at batch 4 shows (measured, bf16): a forward over n query tokens costs V(n) exp(gamma c) with c the
    longest row's context, the draft's calls alike. Steps that draft (n = 8, 12) come at short contexts, target-only
    steps (n = 4) at long ones: a long prompt in the batch is what turns the batch off."""
    v = {4: 0.078, 8: 0.098, 12: 0.107}
    rng = np.random.default_rng(5)
    for _ in range(240):
        n = int(rng.choice([4, 8, 12]))
        c = int(rng.integers(600, 1000) if n == 4 else rng.integers(50, 400))
        f = math.exp(gamma * c) * rng.uniform(0.99, 1.01)
        levels = (n - 4) // 4
        model.observe(n, v[n] * f, levels, 4 * levels, levels * 0.03 * f, 0, c)


def test_online_cost_model_prices_the_context() -> None:
    """The table is at context 0 and an estimate is scaled to the batch's longest row: V(8) / V(4) at one context is
    the true 1.26, where a table by n alone set V(4), learnt at long contexts, against V(8) at short ones (1.06:
    drafting a token a row looked a fifth as dear as it is). The draft is priced at the same context."""
    gamma = 0.3e-3
    model = OnlineCostModel()
    _context_steps(model, gamma)
    assert model.context_factor(1000) == pytest.approx(math.exp(gamma * 1000), rel=0.03)
    for c in (100, 800):
        est = model.estimate(4, 20, c)
        assert est.verify(4) == pytest.approx(0.078 * math.exp(gamma * c), rel=0.03)
        assert est.verify(8) / est.verify(4) == pytest.approx(0.098 / 0.078, rel=0.03)
        assert est.draft(4) == pytest.approx(0.03 * math.exp(gamma * c), rel=0.05)
    blind = OnlineCostModel()  # the same forwards, no context given: today's table by n
    for i in range(240):
        n = [4, 8, 12][i % 3]
        blind.observe(n, {4: 0.078 * math.exp(gamma * 800), 8: 0.098 * math.exp(gamma * 225),
                          12: 0.107 * math.exp(gamma * 225)}[n], 0, 0, 0.0)
    assert blind.estimate(4, 20).verify(8) / blind.estimate(4, 20).verify(4) < 1.07
    assert blind.context_factor(1000) == 1.0


@pytest.mark.filterwarnings("error")  # no 0/0 while a window holds one context per n and the prior is 0
def test_context_slope_is_within_n_never_negative_and_forgets() -> None:
    from dsde_core.cost import ContextSlope

    slope = ContextSlope(window=100, prior=0.0)
    for i in range(100):  # n = 4 slow at long contexts, n = 16 fast at short ones: no slope within either n
        slope.observe(4, 900 + i % 2, math.log(0.1))
        slope.observe(16, 100 + i % 2, math.log(0.05))
    assert slope.value == pytest.approx(0.0, abs=1e-9)  # (a regression across n would read one from their gap)
    for i in range(100):  # longer contexts faster: never below 0
        slope.observe(4, 100 + 8 * i, math.log(0.1) - 1e-4 * 8 * i)
    assert slope.value == 0.0
    for i in range(100):
        slope.observe(4, 100 + 8 * i, math.log(0.1) + 2e-4 * 8 * i)
    assert slope.value == pytest.approx(2e-4)
    for i in range(100):  # the window has moved past them: flat again
        slope.observe(4, 100 + 8 * i, math.log(0.1))
    assert slope.value == pytest.approx(0.0, abs=1e-12)
    shrunk = ContextSlope(window=100, prior=100 * 256.0**2)  # a prior worth as much as the data's spread halves it
    for i in range(100):
        c = 512 * (i % 2)  # 256 +- 256
        shrunk.observe(4, c, math.log(0.1) + 2e-4 * c)
    assert shrunk.value == pytest.approx(1e-4)


def test_isotonic_fit_pools_what_decreases_by_weight() -> None:
    from dsde_core.cost import isotonic

    assert isotonic([1.0, 3.0, 2.0, 4.0], [1, 1, 3, 1]).tolist() == pytest.approx([1.0, 2.25, 2.25, 4.0])
    assert isotonic([5.0, 1.0, 1.0], [1, 1, 1]).tolist() == pytest.approx([7 / 3] * 3)
    assert isotonic([1.0, 2.0], [1, 1]).tolist() == [1.0, 2.0]


def test_online_cost_model_recovers_the_draft_forward() -> None:
    rng = np.random.default_rng(2)
    model = OnlineCostModel()
    d0, d1, v = 0.04, 0.005, 0.15
    for _ in range(200):
        rows = [int(r) for r in rng.integers(1, 9, int(rng.integers(1, 9)))]  # rows drafting at each level
        model.observe(4 + sum(rows), v, len(rows), sum(rows), sum(d0 + d1 * r for r in rows))
    assert model.estimate(4).draft(3) == pytest.approx(d0 + 3 * d1, rel=0.05)


def test_online_cost_model_relearns_the_draft_after_a_pause() -> None:
    """A burst of other work makes the draft look 60% slower; drafting then stops for longer than the fit's memory
    (every row off). Once the draft is timed again, a few calls at its true cost price it again; without the pause,
    the burst's 200 calls still outweigh 32 new ones."""
    def d1_after(pause: int, calls: int) -> float:
        model = OnlineCostModel()
        for i in range(200):
            k, m = 1 + i % 6, 1 + i % 4  # k levels of m rows each
            model.observe(m * (1 + k), 0.15, k, k * m, k * (0.059 + 0.0147 * m))
        for _ in range(pause):
            model.observe(1, 0.15, 0, 0, 0.0)  # target-only steps
        for i in range(calls):
            k, m = 1 + i % 3, 1 + i % 4
            model.observe(m * (1 + k), 0.15, k, k * m, k * (0.04 + 0.005 * m))
        return model.estimate(1).draft(1)

    assert d1_after(60, 4) == pytest.approx(0.045, rel=0.1)
    assert d1_after(0, 32) > 0.06 and d1_after(40, 4) > 0.06  # a pause within the fit's memory reopens nothing


def test_policy_tracks_its_own_speedup_per_batch_size() -> None:
    """lambda_B = rho_B * B / V(B): rho starts strict (2) and follows the speedup the policy's steps reach, priced by
    the tables; a batch size not seen yet borrows the nearest one's."""
    pol = GoodputPolicy()
    costs = _costs(batch=2)
    seqs = [SeqInfo("a", 0.0, 8), SeqInfo("b", 0.0, 8)]
    assert pol._speedup.get(2) == 2.0
    for _ in range(80):
        pol.plan(seqs, costs)  # every step: 3 drafted, 2 accepted by each sequence
        pol.observe([StepFeedback(s.req_id, 8, 3, 2, (0.1,) * 3, (), (0.9,) * 3) for s in seqs])
    want = (6 / costs.step_s([3, 3])) / (2 / costs.verify(2))
    assert pol._speedup.get(2) == pytest.approx(want, rel=1e-3)
    assert pol._speedup.get(3) == pol._speedup.get(2)
    plans = pol.plan(seqs, costs)
    assert plans[0].stop.goodput >= want * 2 / costs.verify(2) * (1 - 1e-9)


def test_online_cost_model_leaves_its_prior_within_tens_of_steps() -> None:
    """The draft prior is worth CostPrior.weight (4) observations, not hundreds: 40 batch-1 steps on hardware twice
    as slow as the prior already give the costs within 10%."""
    model = OnlineCostModel()
    v, d = 0.16, 0.04  # the prior: ~0.08 and ~0.022
    for i in range(40):
        k = i % 7
        model.observe(1 + k, v, k, k, d * k)
    est = model.estimate(1)
    assert est.verify(3) == pytest.approx(v, rel=0.1)
    assert est.draft(1) == pytest.approx(d, rel=0.1)


def test_engine_feeds_its_cost_model_every_step() -> None:
    """Every step's target forward (a prompt's too: the table is by query tokens) and draft call, with the context
    tokens the draft took in (a first draft step's prefill prices C, not D) and the longest row's context."""
    engine = tiny_engine("static:3", batch=2)
    calls = []
    observe = engine.costs.observe
    engine.costs.observe = lambda *a: calls.append(a) or observe(*a)
    for p in random_prompts(2, seed=5, min_len=20):
        engine.add_request(p, SamplingParams(max_tokens=12))
    engine.run()
    log = list(engine.step_log)
    assert len(calls) == len(log) == engine.costs.observed
    assert sum(c[2] > 0 for c in calls) > 0
    # static:3 drafts in the prompts' step: the draft takes in both contexts there (prices C), later only new tokens
    assert log[0].prefill and calls[0][5] >= 2 * 19 and all(c[5] == 0 for c in calls[1:])
    assert engine.costs._context is not None and engine.costs._context[1] == 1
    assert max(engine.costs._median) >= 20  # a prompt's forward is in the table
    assert engine.costs.estimate(2).verify(2) > 0
    assert [c[6] for c in calls] == [max(s.contexts) for s in log]  # the longest row's committed tokens, every step
    assert calls[-1][6] > calls[0][6] >= 20


def test_online_cost_model_prices_context_tokens_apart_from_decode_rows() -> None:
    """A draft call that took in a prefill teaches C (its time beyond D over its context tokens), not D: decode rows at
    5 ms and context tokens at 0.4 ms are both recovered."""
    model = OnlineCostModel()
    d0, d1, c = 0.03, 0.005, 0.0004
    rng = np.random.default_rng(2)
    for i in range(200):
        forwards, rows = int(rng.integers(1, 6)), int(rng.integers(1, 20))
        context = int(rng.integers(100, 800)) if i % 5 == 0 else 0
        model.observe(2, 0.14, forwards, rows, (d0 * forwards + d1 * rows + c * context) * rng.uniform(0.98, 1.02),
                      context)
    est = model.estimate(1)
    assert est.context_per_token_s == pytest.approx(c, rel=0.1)
    assert est.draft(1) == pytest.approx(d0 + d1, rel=0.1) and est.draft(11) - est.draft(1) == pytest.approx(
        10 * d1, rel=0.1)


def test_an_untimed_draft_is_priced_as_a_share_of_the_target() -> None:
    """Before its first draft step the model prices a draft forward as the prior's share of the target's forward as
    measured: a fast (tiny, or GPU) target does not make drafting look dear."""
    model = OnlineCostModel()
    for _ in range(5):
        model.observe(1, 0.001, 0, 0, 0.0)  # a target forward of 1 ms
    assert model.estimate(1).draft(1) == pytest.approx(0.001 * (0.020 + 0.002) / 0.080)


def test_draft_worker_obeys_the_stop_rule() -> None:
    """The same two rows: a goodput too high for any draft token to pay ends both after one token; a tiny one lets
    both draft to their k; rows without p_next are not governed by the rule."""
    engine = tiny_engine("off", batch=3)
    draft: DraftWorker = engine.draft
    prompts = random_prompts(3, seed=4)
    for slot in range(3):
        draft.open(slot, SamplingParams())

    def propose(goodput: float) -> list[int]:
        for slot in range(3):
            draft.release(slot)
            draft.open(slot, SamplingParams())
        stop = DraftStop(_costs(batch=3), 3, goodput)
        tasks = [DraftTask(0, prompts[0], 6, None, 0.9, CONFIDENCE_AS_P),
                 DraftTask(1, prompts[1], 6, None, 0.9, CONFIDENCE_AS_P),
                 DraftTask(2, prompts[2], 4)]
        props = draft.propose(tasks, stop)
        assert all(len(p.conf) == len(p.tokens) and all(0 < c <= 1 for c in p.conf) for p in props)
        return [len(p.tokens) for p in props]

    assert propose(1e6) == [1, 1, 4]
    assert propose(1e-6) == [6, 6, 4]


class _Stateless(SpeculationPolicy):
    """A scripted policy's plan alone: it tracks nothing."""

    def observe(self, feedback):
        pass

    def release(self, req_id):
        pass

    def num_tracked(self):
        return 0


class _Toggle(_Stateless):
    """k = 3, except k = 0 on plan numbers in `off`."""

    def __init__(self, off: range) -> None:
        self.off, self.n = off, 0

    def plan(self, seqs, costs=None, waiting=0):
        self.n += 1
        return [Plan(0 if self.n in self.off else min(3, s.max_k)) for s in seqs]


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


class _PerRequestOff(_Stateless):
    """Applies the inner toggle to one request only; the others always draft k = 3."""

    def __init__(self, inner: _Toggle, req_id: str) -> None:
        self.inner, self.req_id = inner, req_id

    def plan(self, seqs, costs=None, waiting=0):
        toggled = self.inner.plan(seqs, costs, waiting)
        return [t if s.req_id == self.req_id else Plan(min(3, s.max_k)) for s, t in zip(seqs, toggled, strict=True)]


def test_lone_sequence_catches_up_after_max_lag() -> None:
    """A sequence that drafted once and then stops: its draft cache catches up once it lags draft_max_lag tokens
    (bounded staleness)."""
    engine = tiny_engine(_Toggle(range(2, 1000)), batch=1, draft_max_lag=8)
    r = engine.add_request(random_prompts(1, seed=2)[0], SamplingParams(max_tokens=30))
    lags = []
    for _ in range(25):
        engine.step()
        if r.slot is not None:
            lags.append(r.num_tokens - len(engine.draft.slots[r.slot].cached))
    assert max(lags) <= 8 + 1 and min(lags) <= 2


def test_a_sequence_that_never_drafts_never_feeds_the_draft() -> None:
    """Target-only decoding through an engine with a draft: the prompt is a prefill, deferred until the sequence
    drafts, so a request that never speculates costs the draft nothing."""
    engine = tiny_engine("off", batch=2, draft_max_lag=4)
    calls = []
    propose = engine.draft.propose
    engine.draft.propose = lambda tasks, *a: calls.append(tasks) or propose(tasks, *a)
    for p in random_prompts(2, seed=3, min_len=20):
        engine.add_request(p, SamplingParams(max_tokens=20))
    engine.run()
    assert calls == [] and engine.costs.observed > 0


def test_one_rejected_first_token_does_not_switch_a_new_sequence_off() -> None:
    """A sequence's own running means start from the pooled ones, which count as start_weight of its steps: one
    rejected first token (at T=1 a likely draw even from a good draft) moves p_first a fifth of the way to 0, and
    the sequence goes on drafting; a run of them switches it off."""
    def drafting_steps(start_weight: float) -> int:
        cfg = GoodputConfig(start_weight=start_weight, explore_steps=4)  # the lone sequence is the pool's evidence
        pol, seqs, ks = GoodputPolicy(cfg), [SeqInfo("s", 1.0, 8)], []
        for _ in range(12):
            plans = pol.plan(seqs, CPU)
            ks.append(plans[0].k)
            _feed(pol, plans, seqs, lambda k: 0, conf=0.8)
            if len(ks) == 1:
                assert pol.stats("s")["p_first"] == pytest.approx(0.7 * start_weight / (start_weight + 1))
        assert ks[-1] == 0
        return ks.index(0)

    assert drafting_steps(GoodputConfig().start_weight) > drafting_steps(1.0) >= 2
