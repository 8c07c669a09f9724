"""DSDE: per-sequence speculation length from the stability of the target/draft KLD (arXiv 2509.01083).

Per request, in two phases (KLD: KL(target || draft) at each proposed position, signals.py; N = `window`).

Warm-up, until the request has N KLD values: k starts at init_sl and doubles, up to max_sl, after every step in which
every proposed token was accepted; otherwise it stays. maxAcc (the most tokens accepted in one warm-up step) and every
warm-up KLD (KLD_warm) are recorded. At the end of the step that brings the count to >= N, once:
    SL_max = clamp(round(maxAcc * (1 + c * mean(KLD_warm) / max(KLD_warm))), [min_sl, max_sl])
    SL_min = clamp(ceil(SL_max / 10), [min_spec, SL_max])     rule "code"
    SL_min = min(paper_sl_min, SL_max)                         rule "paper"
(round is half-up; max(KLD_warm) = 0 makes the ratio term 0, as in the authors' code.)

Every later step that proposed something (and the calibrating step itself):
    WVIR   = signals.wvir(last N KLDs, delta)
    SF     = signals.scale_factor(mean KLD over this step's proposed positions, T, divide_sf_by_temperature)
    SL_hat = SL_min                                                     if WVIR * SF > 1
           = max(SL_min, ceil((SL_max - SL_min) * (1 - WVIR * SF) + SL_min))   otherwise
and the next plan is k = min(SL_hat, max_k). Post-warm-up requests are "cappable" (cap.py).

Variants (`variant` sets these defaults; each field can be set on its own):
    field                     "code" (authors' vLLM fork)             "paper"
    window N, delta, c        30, 0.9, 0.5                            30, 0.85, 1.0
    sl_min_rule               ceil(SL_max / 10), floored at min_spec  paper_sl_min (2)
    divide_sf_by_temperature  True                                    False
The paper's short window (10) is WVIR's newest max(1, n // 3) values: N // 3 once warm-up has filled the history.
The default is "code", the more specific text (temperature, clamping, the SL_min rule); "dsde-paper" is the other.

min_spec defaults to 2, the paper's SL_min. The authors' 6 (AUTHORS_MIN_SPEC) suits a 70B target with a 1B draft on
GPUs, where a draft token costs a few percent of a target step. Where it costs 40% (the default pair on a CPU is near
that), at acceptance 0.8 the tokens a step per unit cost, (1 - 0.8^(k+1)) / (0.2 (1 + 0.4 k)), peak at k = 2-3 and are
15% lower at k = 6: a floor of 6 would force losing steps exactly when the signal says "unstable". min_sl (SL_max's
floor) defaults to min_spec (code rule) or paper_sl_min (paper rule), one k_min bounding both as in the authors' code,
so SL_min <= SL_max.

Where the sources are silent: a step that proposed nothing adds no KLD and changes nothing; a draft that proposed
fewer tokens than planned counts only those (that many KLDs, SF over their mean, and warm-up doubles k from its planned
value when every *proposed* token was accepted); KLD_warm holds every warm-up KLD, all of the calibrating step's
included, while the WVIR history keeps the newest N; KLDs are floored at 0 (round-off); SL_hat's ceil ignores float
noise below 1e-9 (6.000000000001 stays 6).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from dsde_core.errors import ConfigError
from dsde_core.policies.base import PerRequestPolicy, Plan, SeqInfo, StepFeedback
from dsde_core.signals import scale_factor, wvir

Variant = Literal["code", "paper"]

VARIANT_DEFAULTS: dict[str, dict[str, object]] = {
    "code": dict(window=30, delta=0.9, c=0.5, sl_min_rule="code", divide_sf_by_temperature=True),
    "paper": dict(window=30, delta=0.85, c=1.0, sl_min_rule="paper", divide_sf_by_temperature=False),
}

DEFAULT_MIN_SPEC = 2
"""The code rule's SL_min floor by default: the paper's SL_min (the module docstring says why not the authors' 6)."""

AUTHORS_MIN_SPEC = 6  # the authors' code's floor, for reproducing it

CEIL_TOLERANCE = 1e-9  # SL_hat's ceil ignores float noise below this


@dataclass(frozen=True)
class DSDEConfig:
    variant: Variant = "code"
    window: int | None = None
    """N: KLD history length and warm-up length, in KLD values (= proposed tokens)."""
    delta: float | None = None
    """WVIR weight decay per position into the past."""
    c: float | None = None
    """Weight of mean/max warm-up KLD in SL_max."""
    sl_min_rule: Literal["code", "paper"] | None = None
    divide_sf_by_temperature: bool | None = None
    min_spec: int = DEFAULT_MIN_SPEC
    """Code rule: SL_min >= min_spec (then <= SL_max)."""
    paper_sl_min: int = 2
    """Paper rule: SL_min = paper_sl_min (then <= SL_max)."""
    min_sl: int | None = None
    """Floor of SL_max. None: min_spec (code rule) or paper_sl_min (paper rule)."""
    init_sl: int = 5
    max_sl: int = 20

    def __post_init__(self) -> None:
        if self.variant not in VARIANT_DEFAULTS:
            raise ConfigError(f"dsde: variant must be 'code' or 'paper', got {self.variant!r}")
        for name, value in VARIANT_DEFAULTS[self.variant].items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if self.sl_min_rule not in ("code", "paper"):
            raise ConfigError(f"dsde: sl_min_rule must be 'code' or 'paper', got {self.sl_min_rule!r}")
        if self.min_sl is None:
            floor = self.min_spec if self.sl_min_rule == "code" else self.paper_sl_min
            object.__setattr__(self, "min_sl", min(floor, self.max_sl))
        if self.window < 2:
            raise ConfigError(f"dsde: window must be >= 2 (WVIR needs two values), got {self.window}")
        if not 0.0 < self.delta <= 1.0:
            raise ConfigError(f"dsde: delta must be in (0, 1], got {self.delta}")
        if self.c < 0:
            raise ConfigError(f"dsde: c must be >= 0, got {self.c}")
        if not 1 <= self.init_sl <= self.max_sl:
            raise ConfigError(f"dsde: need 1 <= init_sl <= max_sl, got {self.init_sl} and {self.max_sl}")
        if not 1 <= self.min_sl <= self.max_sl:
            raise ConfigError(f"dsde: need 1 <= min_sl <= max_sl, got {self.min_sl} and {self.max_sl}")
        if not 1 <= self.min_spec <= self.max_sl:
            raise ConfigError(f"dsde: need 1 <= min_spec <= max_sl, got min_spec={self.min_spec}")
        if not 1 <= self.paper_sl_min <= self.max_sl:
            raise ConfigError(f"dsde: need 1 <= paper_sl_min <= max_sl, got paper_sl_min={self.paper_sl_min}")


def calibrate_bounds(max_acc: int, kld_warm: list[float], cfg: DSDEConfig) -> tuple[int, int]:
    """(SL_max, SL_min) from the warm-up, once per request."""
    mean_kld = sum(kld_warm) / len(kld_warm) if kld_warm else 0.0
    max_kld = max(kld_warm, default=0.0)
    ratio = mean_kld / max_kld if max_kld > 0 else 0.0
    # SL_max = clamp(round(maxAcc * (1 + c * mean/max)), [min_sl, max_sl]): a mostly-calm warm-up
    # (mean well below max) gets little headroom over the best warm-up step, a uniformly calm one up to c.
    sl_max = min(cfg.max_sl, max(cfg.min_sl, math.floor(max_acc * (1.0 + cfg.c * ratio) + 0.5)))
    if cfg.sl_min_rule == "code":
        # SL_min = clamp(ceil(0.1 * SL_max), [min_spec, SL_max]), as ceil(SL_max / 10) in integers
        # (in floats 0.1 * 30 = 3.0000000000000004 would ceil to 4).
        sl_min = min(sl_max, max(cfg.min_spec, -(-sl_max // 10)))
    else:
        sl_min = min(sl_max, cfg.paper_sl_min)
    return sl_max, sl_min


def sl_hat(wvir_value: float, sf: float, sl_min: int, sl_max: int) -> int:
    """DSDE's SL rule: SL_min when WVIR * SF > 1, else interpolate from SL_max down towards SL_min."""
    x = wvir_value * sf
    if x > 1.0:  # instability rising and the current divergence large: speculate at the floor
        return sl_min
    return max(sl_min, math.ceil((sl_max - sl_min) * (1.0 - x) + sl_min - CEIL_TOLERANCE))


@dataclass
class _State:
    temperature: float
    k: int  # the k the next plan asks for (before max_k)
    history: deque[float]
    warm: bool = True
    max_acc: int = 0
    kld_warm: list[float] = field(default_factory=list)
    sl_max: int | None = None
    sl_min: int | None = None
    last_wvir: float | None = None
    last_sf: float | None = None
    last_mean_kld: float | None = None


class DSDEPolicy(PerRequestPolicy[_State]):
    name = "dsde-nocap"
    bound_field = "max_sl"

    def __init__(self, config: DSDEConfig | None = None) -> None:
        super().__init__()
        self.config = config or DSDEConfig()

    def _new_state(self, seq: SeqInfo) -> _State:
        cfg = self.config
        return _State(temperature=seq.temperature, k=cfg.init_sl, history=deque(maxlen=cfg.window))

    def _propose(self, state: _State, seq: SeqInfo) -> Plan:
        state.temperature = seq.temperature
        return Plan(k=state.k)

    def cappable(self, req_id: str) -> bool:
        state = self._state_of(req_id)
        return state is not None and not state.warm

    def _update(self, state: _State, fb: StepFeedback) -> None:
        if fb.proposed == 0:
            return
        cfg = self.config
        klds = [max(0.0, v) for v in fb.kld]
        state.history.extend(klds)
        if state.warm:
            state.max_acc = max(state.max_acc, fb.accepted)
            state.kld_warm.extend(klds)
            if fb.all_accepted:
                state.k = min(2 * state.k, cfg.max_sl)
            if len(state.history) < cfg.window:
                return
            state.sl_max, state.sl_min = calibrate_bounds(state.max_acc, state.kld_warm, cfg)
            state.warm = False
            state.kld_warm = []
        mean_kld = sum(klds) / len(klds)
        state.last_mean_kld = mean_kld
        state.last_wvir = wvir(state.history, cfg.delta)
        state.last_sf = scale_factor(mean_kld, state.temperature, cfg.divide_sf_by_temperature)
        state.k = sl_hat(state.last_wvir, state.last_sf, state.sl_min, state.sl_max)

    def _stats(self, state: _State) -> dict[str, float]:
        out = {"warm": float(state.warm), "k": float(state.k), "num_kld": float(len(state.history)),
               "max_acc": float(state.max_acc)}
        if not state.warm:
            out["sl_hat"] = float(state.k)
            out["sl_max"] = float(state.sl_max)
            out["sl_min"] = float(state.sl_min)
        for key, value in (("wvir", state.last_wvir), ("scale_factor", state.last_sf),
                           ("mean_kld", state.last_mean_kld)):
            if value is not None:
                out[key] = value
        return out
