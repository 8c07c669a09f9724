"""Every SL policy on scripted feedback: the exact k step by step."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import numpy as np
import pytest

from dsde_core.errors import ConfigError
from dsde_core.policies import (
    POLICY_NAMES,
    AcceptanceRateConfig,
    AcceptanceRatePolicy,
    AdaEDLConfig,
    AdaEDLPolicy,
    CappedPolicy,
    DSDEConfig,
    DSDEPolicy,
    HeuristicConfig,
    HeuristicPolicy,
    OffPolicy,
    Plan,
    SeqInfo,
    SpeculationPolicy,
    StaticPolicy,
    StepFeedback,
    ceiling_note,
    draft_confidence,
    make_policy,
    should_stop,
)
from dsde_core.policies.dsde import calibrate_bounds, sl_hat


def seq(req_id: str = "r", max_k: int = 100, temperature: float = 0.0) -> SeqInfo:
    return SeqInfo(req_id=req_id, temperature=temperature, max_k=max_k)


def fb(req_id: str, planned: int, accepted: int, klds: Sequence[float] | None = None,
       proposed: int | None = None) -> StepFeedback:
    proposed = planned if proposed is None else proposed
    klds = [0.1] * proposed if klds is None else klds
    return StepFeedback(req_id=req_id, planned=planned, proposed=proposed, accepted=accepted, kld=tuple(klds))


def k_of(policy: SpeculationPolicy, s: SeqInfo) -> int:
    (p,) = policy.plan([s])
    return p.k


# ---------------------------------------------------------------- interface dataclasses


def test_feedback_validation() -> None:
    with pytest.raises(ValueError, match="accepted <= proposed"):
        StepFeedback("r", planned=3, proposed=2, accepted=3, kld=(0.1, 0.1))
    with pytest.raises(ValueError, match="proposed <= planned"):
        StepFeedback("r", planned=2, proposed=3, accepted=0, kld=(0.1,) * 3)
    with pytest.raises(ValueError, match="one KLD per proposed"):
        StepFeedback("r", planned=3, proposed=3, accepted=0, kld=(0.1,))
    with pytest.raises(ValueError, match="draft_entropy"):
        StepFeedback("r", planned=2, proposed=2, accepted=0, kld=(0.1, 0.1), draft_entropy=(1.0,))
    f = StepFeedback("r", planned=2, proposed=2, accepted=2, kld=[0.1, 0.2])  # lists become tuples
    assert f.kld == (0.1, 0.2) and f.all_accepted and f.acceptance == 1.0
    assert StepFeedback("r", planned=0, proposed=0, accepted=0).acceptance is None
    with pytest.raises(ConfigError):
        SeqInfo("r", temperature=0.0, max_k=-1)
    with pytest.raises(ConfigError):
        SeqInfo("r", temperature=-0.5, max_k=3)
    with pytest.raises(ValueError):
        Plan(k=-1)
    with pytest.raises(ValueError):
        Plan(k=1, min_confidence=1.5)


# ---------------------------------------------------------------- static / off


def test_static_and_off() -> None:
    static = StaticPolicy(4)
    assert [p.k for p in static.plan([seq("a"), seq("b", max_k=2), seq("c", max_k=0)])] == [4, 2, 0]
    static.observe([fb("a", 4, 0)])
    assert k_of(static, seq("a")) == 4
    assert static.num_tracked() == 0 and static.name == "static:4"
    off = OffPolicy()
    assert [p.k for p in off.plan([seq("a"), seq("b", max_k=7)])] == [0, 0]
    assert off.name == "off"
    with pytest.raises(ConfigError):
        StaticPolicy(-1)


# ---------------------------------------------------------------- heuristic


def test_heuristic_up_down_floor_and_ceiling() -> None:
    pol = HeuristicPolicy()  # initial 5
    ks = []
    for accepted_all in [True, True, False, False, True]:
        k = k_of(pol, seq())
        ks.append(k)
        pol.observe([fb("r", k, k if accepted_all else k - 1)])
    # 5 -all-> 7 -all-> 9 -miss-> 8 -miss-> 7 -all-> 9
    assert ks == [5, 7, 9, 8, 7]
    assert k_of(pol, seq()) == 9

    floor = HeuristicPolicy(HeuristicConfig(initial_k=2))
    ks = []
    for _ in range(3):
        k = k_of(floor, seq())
        ks.append(k)
        floor.observe([fb("r", k, 0)])
    assert ks == [2, 1, 1]  # max(1, k - 1)

    top = HeuristicPolicy(HeuristicConfig(initial_k=19, max_k=20))
    top.observe([])
    k = k_of(top, seq())
    top.observe([fb("r", k, k)])
    assert k_of(top, seq()) == 20


def test_heuristic_short_proposal_and_empty_step() -> None:
    pol = HeuristicPolicy()
    assert k_of(pol, seq(max_k=3)) == 3
    pol.observe([fb("r", 3, 3)])  # every proposed token accepted: +2 on the state k (5 -> 7)
    assert k_of(pol, seq()) == 7
    pol.observe([fb("r", 0, 0)])  # nothing proposed: no change
    assert k_of(pol, seq()) == 7


# ---------------------------------------------------------------- acceptance rate


def test_acceptance_rate_steps_and_dead_band() -> None:
    pol = AcceptanceRatePolicy(AcceptanceRateConfig(threshold=0.7, initial_k=5))
    script = [(5, 5), (6, 0), (5, 2)]  # (expected k, accepted)
    for want_k, accepted in script:
        k = k_of(pol, seq())
        assert k == want_k
        pol.observe([fb("r", k, accepted)])
    # rates 1.0 -> mean 1.0 > .75: 6; then 0.0 -> mean .5 < .65: 5; then 0.4 -> mean .4667: 4
    assert k_of(pol, seq()) == 4

    band = AcceptanceRatePolicy(AcceptanceRateConfig(threshold=0.7, initial_k=5, band=0.05))
    for _ in range(6):
        assert k_of(band, seq()) == 5
        band.observe([StepFeedback("r", planned=10, proposed=10, accepted=7, kld=(0.1,) * 10)])
    assert k_of(band, seq()) == 5  # mean 0.7 sits in the dead band [0.65, 0.75]
    # rates .8: means (6*.7 + .8)/7 = .714 and (6*.7 + 1.6)/8 = .725 -> still in the band
    for acc, want in [(8, 5), (8, 5)]:
        band.observe([StepFeedback("r", planned=10, proposed=10, accepted=acc, kld=(0.1,) * 10)])
        assert k_of(band, seq()) == want
    band.observe([StepFeedback("r", planned=10, proposed=10, accepted=10, kld=(0.1,) * 10)])
    assert k_of(band, seq()) == 6  # (6*.7 + 1.6 + 1.0)/9 = .7556 > .75


def test_acceptance_rate_window_and_bounds() -> None:
    pol = AcceptanceRatePolicy(AcceptanceRateConfig(threshold=0.7, initial_k=5, window=10))
    ks = []
    for _ in range(10):  # all accepted: +1 per step up to the bound 10
        k = k_of(pol, seq())
        ks.append(k)
        pol.observe([fb("r", k, k)])
    assert ks == [5, 6, 7, 8, 9, 10, 10, 10, 10, 10]
    ks = []
    for _ in range(5):  # all rejected: the window holds ten 1.0s, so the mean falls .9, .8, .7, .6, .5
        k = k_of(pol, seq())
        ks.append(k)
        pol.observe([fb("r", k, 0)])
    assert ks == [10, 10, 10, 10, 9]
    assert pol.stats("r")["acceptance_mean"] == pytest.approx(0.5)  # a window of 10, not all 15
    for _ in range(20):
        k = k_of(pol, seq())
        pol.observe([fb("r", k, 0)])
    assert k_of(pol, seq()) == 2  # lower bound
    assert k_of(pol, seq(max_k=1)) == 1  # the engine's max_k wins over min_k


# ---------------------------------------------------------------- AdaEDL


def test_adaedl_plan_and_lambda_arithmetic() -> None:
    pol = AdaEDLPolicy()  # max_k 10, lambda_0 0.5, target 0.9
    (p,) = pol.plan([seq()])
    assert p == Plan(k=10, min_confidence=0.5)
    (p,) = pol.plan([seq(max_k=4)])
    assert p.k == 4 and p.min_confidence == 0.5

    pol.observe([fb("r", 10, 2, proposed=5)])  # stopped early at 5; 2/5 = .4 < .9: lambda' = .51
    lam = 0.9 * 0.5 + 0.1 * 0.51
    assert pol.stats("r")["lambda"] == pytest.approx(lam) == pytest.approx(0.501)
    assert pol.plan([seq()])[0].min_confidence == pytest.approx(0.501)

    pol.observe([fb("r", 10, 5, proposed=5)])  # 1.0 >= .9: lambda' = lambda - .01
    lam = 0.9 * lam + 0.1 * (lam - 0.01)
    assert pol.stats("r")["lambda"] == pytest.approx(lam) == pytest.approx(0.5)

    pol.observe([fb("r", 10, 9, proposed=10)])  # exactly the target counts as "at or above"
    assert pol.stats("r")["lambda"] == pytest.approx(0.499)

    pol.observe([fb("r", 10, 0, proposed=0)])  # nothing proposed: unchanged
    assert pol.stats("r")["lambda"] == pytest.approx(0.499)


def test_adaedl_lambda_clamped() -> None:
    hi = AdaEDLPolicy(AdaEDLConfig(lambda_0=1.0))
    hi.plan([seq()])
    hi.observe([fb("r", 10, 0)])
    assert hi.stats("r")["lambda"] == 1.0
    lo = AdaEDLPolicy(AdaEDLConfig(lambda_0=0.0))
    lo.plan([seq()])
    lo.observe([fb("r", 10, 10)])
    assert lo.stats("r")["lambda"] == 0.0


def test_adaedl_confidence_rule() -> None:
    import torch

    uniform4 = torch.full((4,), 0.25)
    conf = draft_confidence(uniform4).item()
    assert conf == pytest.approx(1 - math.sqrt(0.1 * math.log(4)), rel=1e-6)  # 0.6277
    assert draft_confidence(torch.tensor([1.0, 0.0])).item() == 1.0
    assert should_stop(conf, 0.7) and not should_stop(conf, 0.6) and not should_stop(conf, None)


# ---------------------------------------------------------------- DSDE


def test_dsde_variant_defaults_and_overrides() -> None:
    code = DSDEConfig()
    assert (code.variant, code.window, code.delta, code.c) == ("code", 30, 0.9, 0.5)
    assert (code.sl_min_rule, code.divide_sf_by_temperature) == ("code", True)
    assert (code.min_spec, code.min_sl) == (2, 2)
    assert (code.init_sl, code.max_sl) == (5, 20)
    paper = DSDEConfig(variant="paper")
    assert (paper.window, paper.delta, paper.c, paper.sl_min_rule) == (30, 0.85, 1.0, "paper")
    assert paper.divide_sf_by_temperature is False and paper.min_sl == 2
    mixed = DSDEConfig(variant="paper", delta=0.9, divide_sf_by_temperature=True)
    assert (mixed.delta, mixed.c, mixed.divide_sf_by_temperature) == (0.9, 1.0, True)
    assert DSDEConfig(min_spec=6).min_sl == 6
    for bad in [dict(variant="x"), dict(window=1), dict(delta=0.0), dict(c=-1.0), dict(init_sl=21),
                dict(min_spec=0), dict(min_sl=30), dict(sl_min_rule="other")]:
        with pytest.raises(ConfigError):
            DSDEConfig(**bad)


def test_dsde_warmup_doubles_to_max() -> None:
    pol = DSDEPolicy(DSDEConfig(window=1000))
    ks = []
    for _ in range(5):
        k = k_of(pol, seq())
        ks.append(k)
        pol.observe([fb("r", k, k)])
    assert ks == [5, 10, 20, 20, 20]
    assert not pol.cappable("r") and pol.stats("r")["warm"] == 1.0

    partial = DSDEPolicy(DSDEConfig(window=1000))
    ks = []
    for accepted in [5, 4, 10, 0]:
        k = k_of(partial, seq())
        ks.append(k)
        partial.observe([fb("r", k, accepted)])
    assert ks == [5, 10, 10, 20]  # 5/5 doubles, 4/10 stays, 10/10 doubles, 0/20 stays
    assert partial.stats("r")["max_acc"] == 10.0


def test_dsde_short_proposal_and_empty_step() -> None:
    pol = DSDEPolicy(DSDEConfig(window=1000))
    assert k_of(pol, seq(max_k=3)) == 3
    pol.observe([fb("r", 3, 3)])  # every proposed token accepted: the state k doubles 5 -> 10
    assert k_of(pol, seq()) == 10
    pol.observe([fb("r", 10, 2, proposed=4, klds=[0.1] * 4)])  # a short proposal adds 4 KLDs, no doubling
    assert pol.stats("r")["num_kld"] == 7.0 and k_of(pol, seq()) == 10
    pol.observe([fb("r", 0, 0)])  # k = 0 step: no KLD, nothing changes
    assert pol.stats("r")["num_kld"] == 7.0 and k_of(pol, seq()) == 10


def _np_wvir(x: list[float], delta: float) -> float:
    x = np.asarray(x)

    def wvar(v: np.ndarray) -> float:
        w = delta ** np.arange(len(v) - 1, -1, -1.0)
        mu = (w * v).sum() / w.sum()
        return float((w * (v - mu) ** 2).sum() / w.sum())

    return wvar(x[-(len(x) // 3):]) / wvar(x)


CALM = [0.1] * 5
SPIKE = [0.1] * 9 + [0.6]  # KLD_warm over both steps: mean 2.0/15 = 0.1333, max 0.6, mean/max = 2/9


def _warm_up(pol: DSDEPolicy, req: str, second_accepted: int, temperature: float = 0.0,
             first: Sequence[float] = CALM, second: Sequence[float] = SPIKE) -> None:
    """Two warm-up steps for window = 6: 5 of 5 accepted (k 5 -> 10), then 10 proposed."""
    assert k_of(pol, seq(req, temperature=temperature)) == 5
    pol.observe([fb(req, 5, 5, klds=first)])
    assert k_of(pol, seq(req, temperature=temperature)) == 10
    assert not pol.cappable(req)
    pol.observe([fb(req, 10, second_accepted, klds=second)])
    assert pol.cappable(req)


def test_dsde_transition_code_variant_by_hand() -> None:
    pol = DSDEPolicy(DSDEConfig(window=6))  # code: delta .9, c .5, min_spec 2, SF / T
    _warm_up(pol, "a", second_accepted=3)
    st = pol.stats("a")
    # maxAcc = 5: SL_max = round(5 * (1 + 0.5 * 2/9)) = round(5.556) = 6; SL_min = max(2, ceil(0.6)) = 2
    assert (st["sl_max"], st["sl_min"], st["warm"]) == (6.0, 2.0, 0.0)
    # history = last 6 = [.1]*5 + [.6]; WVIR(.9) = 1.4851; SF = exp(2 * 0.15) - 1 = 0.34986 (T = 0 -> 1)
    # WVIR * SF = 0.5196 <= 1: SL_hat = max(2, ceil(4 * (1 - 0.5196) + 2)) = ceil(3.92) = 4
    assert st["wvir"] == pytest.approx(_np_wvir([0.1] * 5 + [0.6], 0.9)) == pytest.approx(1.4851, abs=1e-4)
    assert st["scale_factor"] == pytest.approx(math.exp(0.3) - 1)
    assert st["mean_kld"] == pytest.approx(0.15)
    assert st["sl_hat"] == 4.0
    assert k_of(pol, seq("a")) == 4

    # Post-warm-up step 3: 4 proposed, KLDs [.1, .9, .1, .9] (mean .5): history [.1, .6, .1, .9, .1, .9],
    # WVIR = 1.1516, SF = e^1 - 1 = 1.718, WVIR * SF = 1.98 > 1 -> SL_min = 2
    pol.observe([fb("a", 4, 1, klds=[0.1, 0.9, 0.1, 0.9])])
    assert pol.stats("a")["wvir"] == pytest.approx(_np_wvir([0.1, 0.6, 0.1, 0.9, 0.1, 0.9], 0.9))
    assert k_of(pol, seq("a")) == 2
    # Step 4: KLD 0 at both positions: SF = 0 -> WVIR * SF = 0 -> SL_hat = SL_max = 6
    pol.observe([fb("a", 2, 2, klds=[0.0, 0.0])])
    assert pol.stats("a")["scale_factor"] == 0.0
    assert k_of(pol, seq("a")) == 6
    assert k_of(pol, seq("a", max_k=3)) == 3


@pytest.mark.parametrize(
    ("variant", "sl_max", "k_after"),
    [
        # maxAcc = 10, mean/max = 2/9, T = 0.5, last step mean KLD 0.15, history [.1]*5 + [.6].
        # code:  SL_max = round(10 * (1 + .5 * 2/9)) = round(11.11) = 11; SL_min = max(2, ceil(1.1)) = 2;
        #        SF = exp(2 * .15 / .5) - 1 = 0.8221, WVIR(.9) = 1.4851: product 1.221 > 1 -> SL_min = 2
        ("code", 11, 2),
        # paper: SL_max = round(10 * (1 + 2/9)) = round(12.22) = 12; SL_min = 2 (fixed);
        #        SF = exp(.3) - 1 = 0.3499 (no T), WVIR(.85) = 1.3584: product 0.4752 ->
        #        SL_hat = ceil(10 * (1 - .4752) + 2) = ceil(7.248) = 8
        ("paper", 12, 8),
    ],
)
def test_dsde_both_variants_by_hand(variant: str, sl_max: int, k_after: int) -> None:
    pol = DSDEPolicy(DSDEConfig(variant=variant, window=6))
    _warm_up(pol, "r", second_accepted=10, temperature=0.5)
    st = pol.stats("r")
    assert (st["sl_max"], st["sl_min"]) == (sl_max, 2)
    assert k_of(pol, seq("r", temperature=0.5)) == k_after


def test_dsde_authors_min_spec() -> None:
    # min_spec = 6 (the authors' code): SL_max = 11 as above, SL_min = clamp(ceil(1.1), [6, 11]) = 6
    assert calibrate_bounds(10, [0.1] * 14 + [0.6], DSDEConfig(window=6, min_spec=6)) == (11, 6)
    # maxAcc 2: round(2.22) = 2 is below min_sl = 6, so SL_max = 6 and SL_min = 6
    assert calibrate_bounds(2, [0.1] * 14 + [0.6], DSDEConfig(window=6, min_spec=6)) == (6, 6)
    # zero KLDs: mean/max term is 0 -> SL_max = maxAcc
    assert calibrate_bounds(7, [0.0] * 6, DSDEConfig(window=6)) == (7, 2)
    # ceil(SL_max / 10) in integers: SL_max 30 -> 3, not 4
    assert calibrate_bounds(30, [0.0] * 6, DSDEConfig(window=6, max_sl=40, min_spec=1)) == (30, 3)
    # paper rule with SL_max below paper_sl_min
    assert calibrate_bounds(1, [0.0], DSDEConfig(variant="paper", min_sl=1)) == (1, 1)


def test_sl_hat_rule() -> None:
    assert sl_hat(2.0, 0.6, 2, 10) == 2  # 1.2 > 1 -> SL_min
    assert sl_hat(1.0, 1.0, 2, 10) == 2  # exactly 1: formula gives ceil(2) = 2
    assert sl_hat(0.0, 5.0, 2, 10) == 10
    assert sl_hat(0.5, 0.5, 2, 10) == 8  # ceil(8 * .75 + 2) = 8
    assert sl_hat(0.5, 0.6, 2, 10) == 8  # ceil(8 * .7 + 2) = ceil(7.6) = 8
    assert sl_hat(0.1, 1.0, 3, 9) == 9  # ceil(6 * .9 + 3) = ceil(8.4) = 9
    assert sl_hat(0.1, 0.9, 6, 6) == 6


def test_dsde_calibrates_on_the_step_that_reaches_n() -> None:
    pol = DSDEPolicy(DSDEConfig(window=6))
    k_of(pol, seq())
    pol.observe([fb("r", 5, 2)])  # 5 KLDs: still warm, no doubling
    assert not pol.cappable("r") and k_of(pol, seq()) == 5
    pol.observe([fb("r", 5, 1, proposed=1, klds=[0.2])])  # the 6th KLD: calibrate now
    assert pol.cappable("r")
    st = pol.stats("r")
    # maxAcc 2, KLD_warm = [.1]*5 + [.2]: mean/max = (0.7/6)/0.2 = 0.5833 -> round(2 * 1.2917) = 3
    assert (st["sl_max"], st["sl_min"]) == (3.0, 2.0)


# ---------------------------------------------------------------- the cap


class _Scripted(SpeculationPolicy):
    """Fixed k per request; cappable as told."""

    name = "scripted"

    def __init__(self, ks: dict[str, int], cappable: set[str]) -> None:
        self.ks, self._cappable = ks, cappable

    def plan(self, seqs: Sequence[SeqInfo], costs: object = None, waiting: int = 0) -> list[Plan]:
        return [Plan(k=min(self.ks[s.req_id], s.max_k), min_confidence=0.3) for s in seqs]

    def observe(self, feedback: Sequence[StepFeedback]) -> None:
        pass

    def release(self, req_id: str) -> None:
        self.ks.pop(req_id, None)

    def num_tracked(self) -> int:
        return len(self.ks)

    def cappable(self, req_id: str) -> bool:
        return req_id in self._cappable


def test_cap_mechanics() -> None:
    inner = _Scripted({"a": 4, "b": 2, "c": 10, "w": 20}, cappable={"a", "b", "c"})
    capped = CappedPolicy(inner)
    plans = capped.plan([seq("a"), seq("b"), seq("c"), seq("w")])
    # SL_cap = ceil((4 + 2 + 10) / 3) = ceil(5.33) = 6; "w" is not cappable
    assert [p.k for p in plans] == [4, 2, 6, 20]
    assert all(p.min_confidence == 0.3 for p in plans)
    assert capped.last_cap == 6 and capped.last_capped == {"c"}
    assert capped.stats("c") == {"cap": 6.0, "capped": 1.0}
    # max_k applies after the cap, and the cap uses the policy's own k (c still counts as 10)
    plans = capped.plan([seq("a"), seq("b"), seq("c", max_k=3), seq("w", max_k=5)])
    assert [p.k for p in plans] == [4, 2, 3, 5] and capped.last_cap == 6
    # nobody cappable: no cap
    plans = capped.plan([seq("w")])
    assert [p.k for p in plans] == [20] and capped.last_cap is None


def test_cap_on_dsde_batch_three_post_warmup_one_warm() -> None:
    pol = CappedPolicy(DSDEPolicy(DSDEConfig(window=6)))
    # a: SL_hat 4 (see the code-variant test); c: T = 0.5 pushes WVIR * SF over 1 -> SL_min 2;
    # d: zero KLDs throughout -> WVIR = 20 (flat), SF = 0 -> SL_hat = SL_max = round(10) = 10.
    _warm_up(pol, "a", second_accepted=3)
    _warm_up(pol, "c", second_accepted=10, temperature=0.5)
    _warm_up(pol, "d", second_accepted=10, first=[0.0] * 5, second=[0.0] * 10)
    assert k_of(pol, seq("w")) == 5
    pol.observe([fb("w", 5, 5)])  # w stays in warm-up with k = 10
    batch = [seq("a"), seq("c", temperature=0.5), seq("d"), seq("w")]
    assert [pol.inner.stats(r)["k"] for r in "acdw"] == [4, 2, 10, 10]
    plans = pol.plan(batch)
    # SL_cap = ceil((4 + 2 + 10) / 3) = 6: d is capped to 6; w (warm-up, k 10) is not capped
    assert [p.k for p in plans] == [4, 2, 6, 10]
    assert pol.last_cap == 6 and pol.stats("d")["cap"] == 6.0 and pol.stats("d")["capped"] == 1.0
    assert pol.stats("w")["capped"] == 0.0
    for r in "acdw":
        pol.release(r)
    assert pol.num_tracked() == 0


# ---------------------------------------------------------------- every policy


ALL_SPECS = ["off", "static", "static:6", "dsde", "dsde-nocap", "dsde-paper", "dsde-paper-nocap",
             "adaedl", "heuristic", "acceptance", "acceptance:0.5"]


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_every_policy_respects_max_k_and_releases(spec: str) -> None:
    pol = make_policy(spec)
    rng = random.Random(spec)
    ids = [f"r{i}" for i in range(5)]
    for _ in range(60):
        seqs = [SeqInfo(r, temperature=rng.choice([0.0, 0.7, 1.0]), max_k=rng.choice([0, 1, 2, 3, 7, 50]))
                for r in ids]
        plans = pol.plan(seqs)
        assert len(plans) == len(seqs)
        feedback = []
        for s, p in zip(seqs, plans, strict=True):
            assert 0 <= p.k <= s.max_k, (spec, s, p)
            proposed = rng.randint(0, p.k) if p.min_confidence is not None else p.k
            accepted = rng.randint(0, proposed)
            klds = tuple(rng.expovariate(5.0) for _ in range(proposed))
            feedback.append(StepFeedback(s.req_id, p.k, proposed, accepted, klds))
        pol.observe(feedback)
        for r in ids:
            assert all(isinstance(v, float) for v in pol.stats(r).values())
    assert pol.num_tracked() in (0, len(ids))  # stateless policies track nothing
    for r in ids:
        pol.release(r)
    assert pol.num_tracked() == 0
    pol.release("never-seen")  # a no-op
    pol.observe([StepFeedback("r0", 3, 3, 3, (0.1, 0.1, 0.1))])  # late feedback must not revive state
    assert pol.num_tracked() == 0


def test_state_is_created_lazily_per_request() -> None:
    pol = make_policy("heuristic")
    assert pol.num_tracked() == 0
    pol.plan([seq("a"), seq("b")])
    assert pol.num_tracked() == 2
    pol.observe([fb("a", 5, 5)])
    assert [p.k for p in pol.plan([seq("a"), seq("b"), seq("c")])] == [7, 5, 5]
    pol.release("a")
    assert pol.num_tracked() == 2 and pol.stats("a") == {}


# ---------------------------------------------------------------- make_policy


def test_make_policy_parsing() -> None:
    assert isinstance(make_policy("off"), OffPolicy)
    s = make_policy("static")
    assert isinstance(s, StaticPolicy) and s.config.k == 4 and s.name == "static:4"
    assert make_policy(" Static:7 ").config.k == 7
    d = make_policy("dsde")
    assert isinstance(d, CappedPolicy) and isinstance(d.inner, DSDEPolicy) and d.name == "dsde"
    assert d.inner.config.variant == "code"
    n = make_policy("dsde-nocap")
    assert isinstance(n, DSDEPolicy) and n.name == "dsde-nocap"
    p = make_policy("dsde-paper")
    assert isinstance(p, CappedPolicy) and p.inner.config.variant == "paper"
    assert make_policy("dsde-paper-nocap").config.variant == "paper"
    assert isinstance(make_policy("adaedl"), AdaEDLPolicy)
    assert isinstance(make_policy("heuristic"), HeuristicPolicy)
    a = make_policy("acceptance")
    assert isinstance(a, AcceptanceRatePolicy) and a.config.threshold == 0.7
    assert make_policy("acceptance:0.6").config.threshold == 0.6
    assert set(POLICY_NAMES) == {"off", "static", "dsde", "dsde-nocap", "dsde-paper", "dsde-paper-nocap",
                                 "dsde-goodput", "adaedl", "heuristic", "acceptance"}
    assert make_policy().name == "dsde-goodput"  # the default (DEFAULT_POLICY)


def test_dsde_max_bound() -> None:
    """dsde[:MAX] bounds SL_max and the warm-up's doubling; the rest of the variant stays as it is."""
    d = make_policy("dsde:6")
    assert isinstance(d, CappedPolicy) and d.name == "dsde:6"
    assert (d.inner.config.max_sl, d.inner.config.init_sl, d.inner.config.variant) == (6, 5, "code")
    n = make_policy("dsde-paper-nocap:3")
    assert isinstance(n, DSDEPolicy) and (n.config.max_sl, n.config.init_sl, n.config.variant) == (3, 3, "paper")
    # the warm-up doubles k up to MAX, and SL_max calibrates within [min_sl, MAX] however long the accepted runs
    seq = SeqInfo("r", 0.0, 20)
    ks = []
    for step in range(12):  # 36 KLDs: past the 30-value warm-up
        [plan] = n.plan([seq])
        ks.append(plan.k)
        n.observe([StepFeedback("r", plan.k, plan.k, plan.k, tuple(0.01 * (step % 3 + 1) for _ in range(plan.k)))])
    assert ks[0] == 3 and max(ks) == 3
    state = n._state_of("r")
    assert not state.warm and state.max_acc == 3 and state.sl_max == 3


@pytest.mark.parametrize(("spec", "bound"), [("off", 0), ("static", 4), ("static:30", 30), ("dsde", 20),
                                             ("dsde-paper-nocap:6", 6), ("dsde-goodput", 20), ("heuristic", 20),
                                             ("adaedl", 10), ("acceptance", 10)])
def test_every_policy_names_its_bound_on_k(spec: str, bound: int) -> None:
    """k_bound is the most a policy ever plans; a plan for a sequence the engine allows 64 stays within it."""
    policy = make_policy(spec)
    assert policy.k_bound == bound
    assert all(p.k <= bound for p in policy.plan([seq(f"r{i}", max_k=64) for i in range(3)]))


def test_a_bound_above_the_engines_max_sl_gets_a_note_naming_both() -> None:
    assert ceiling_note(make_policy("static:30"), 20) == (
        "policy static:30 plans k up to 30, above the engine's max_sl 20: no step drafts more than 20 tokens "
        "(raise the engine's max_sl, or lower the bound)")
    assert "dsde:24 plans k up to 24, above the engine's max_sl 8" in ceiling_note(make_policy("dsde:24"), 8)
    assert ceiling_note(make_policy("static:20"), 20) is None and ceiling_note(make_policy("dsde"), 20) is None


@pytest.mark.parametrize("spec", ["fast", "static:x", "static:-1", "static:", "acceptance:2", "dsde:1", "dsde:x",
                                  "dsde-goodput:3", "adaedl:2", ""])
def test_make_policy_errors(spec: str) -> None:
    with pytest.raises(ConfigError) as err:
        make_policy(spec)
    if spec in ("fast", "dsde-goodput:3", ""):
        msg = str(err.value)
        assert all(name in msg for name in ("off", "static", "dsde", "adaedl", "heuristic", "acceptance"))
