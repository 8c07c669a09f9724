"""benchmarks/goodput_ab.py: a policy spec names today's policy or dsde-goodput as it was at a git revision."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from dsde_core.errors import ConfigError
from dsde_core.policies import GoodputPolicy, SeqInfo, StaticPolicy
from tests.bench_scripts import script

ROOT = Path(__file__).resolve().parents[1]


def test_a_revisions_policy_is_loaded_beside_todays() -> None:
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    ab = script("goodput_ab")
    old = ab.build("dsde-goodput@HEAD")
    assert old.name == "dsde-goodput" and type(old) is not GoodputPolicy  # its own module's class
    assert type(old).__module__ == "goodput_at_HEAD"
    plans = old.plan([SeqInfo("a", 0.0, 8, remaining=40), SeqInfo("b", 0.0, 8, remaining=40)])
    assert len(plans) == 2 and all(p.k >= 0 for p in plans)
    assert isinstance(ab.build("static:1"), StaticPolicy) and isinstance(ab.build("dsde-goodput"), GoodputPolicy)
    with pytest.raises(ConfigError, match="no dsde_core/policies/goodput.py at git revision 'no-such-rev'"):
        ab.build("dsde-goodput@no-such-rev")
    with pytest.raises(ConfigError, match="only dsde-goodput takes @REV"):
        ab.build("static:1@HEAD")
