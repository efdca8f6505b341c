"""The random-scenario search (tests/reference/fuzz.py): its indices name the scenarios that
docs/known-gaps.md writes down, and it runs both sides."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from reference.fuzz import main, scenarios
from reference.itemsim import RefJob, RefScenario

GAPS = Path(__file__).resolve().parents[1] / "docs" / "known-gaps.md"


def _documented() -> dict[int, RefScenario]:
    text = GAPS.read_text(encoding="utf-8")
    found = re.findall(r"^## Scenario (\d+) .*?```python\n(.*?)\n```", text, flags=re.S | re.M)
    return {int(i): eval(src, {"RefJob": RefJob, "RefScenario": RefScenario}) for i, src in found}  # noqa: S307 (our own doc)


def test_known_gaps_are_the_generators_scenarios():
    documented = _documented()
    assert len(documented) >= 6, sorted(documented)
    generated = scenarios(max(documented) + 1)
    for idx, sc in documented.items():
        assert generated[idx] == sc, idx


def test_a_scenario_runs_through_both_sides(tmp_path):
    # Scenario 700 was 1.89x item level: the rest of an epoch's last chunk was read at the next
    # epoch's miss ratio, a job finished 10 s early and an idle gap dropped its dataset.
    out = tmp_path / "fuzz.jsonl"
    assert main(["--only", "700", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["idx"] == 700 and rec["system"] == "silod" and rec["seeds"] == [0, 1, 2]
    for job, ratio in rec["ratios"].items():
        assert ratio == pytest.approx(1.0, abs=0.02), (job, ratio)


@pytest.mark.parametrize("args, says", [(["--n", "-1"], "--start and --n must be >= 0"),
                                         (["--only", "3,x"], "give scenario indices as integers"),
                                         (["--only=-3"], "indices >= 0")])
def test_bad_arguments_are_refused(tmp_path, capsys, args, says):
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--out", str(tmp_path / "x")])
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
