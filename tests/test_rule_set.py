"""The session's rule set judges statistics, wherever they come from: the same code judges a live
training (torch, next to the tensor) and a dump (numpy), as replay and `tensordbg check` will."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from models import mlp

from tensordbg.engine.judge import RuleSet
from tensordbg.engine.records import Record
from tensordbg.rules import ExplodingGradient, NaN, Overflow, Rule, default_rules
from tensordbg.sources.contract import SourceError
from tensordbg.sources.live import LiveSource
from tensordbg.statistics import stats_from_numpy


def judge_offline(rules: RuleSet, array: np.ndarray, name: str, kind: str) -> dict[str, float]:
    probe = stats_from_numpy(array[:0], (), name=name, kind=kind, trainable=kind == "grad")
    applicable = rules.applicable(probe)
    stats = stats_from_numpy(array, applicable.wanted, name=name, kind=kind,
                             trainable=kind == "grad")  # fmt: skip
    record = Record(stats, None, 0, array.nbytes, rule_ids=applicable.rule_ids,
                    checks=applicable.checks)  # fmt: skip
    rules.judge(record, measure=None)  # no tensor: only the statistics there are
    return {rules.get(i).rule.name: f.value for i, f in record.findings.items()}


def test_numpy_statistics_get_the_verdicts_a_live_training_gets(watch):
    rules = RuleSet(default_rules(), log=lambda message, level: None)
    assert judge_offline(rules, np.array([1.0, np.nan, 2.0]), "fc.output", "output") == {"NaN": 1.0}
    assert judge_offline(rules, np.array([1.0, np.inf]), "fc.output", "output") == {"Overflow": 1.0}
    assert judge_offline(rules, np.ones(8, dtype=np.float32), "fc.output", "output") == {}
    # The same values, live: the same rules fire.
    model = mlp()
    session = watch(model, on_hit="record", rules=[NaN(), Overflow()])
    x = torch.randn(3, 4)
    x[0, 0] = float("nan")
    model(x)
    session.flush()
    assert {h.rule for h in session.hits} == {"NaN"}


def test_a_rule_that_raises_offline_is_disabled_with_a_warning_and_the_others_judge():
    class Broken(Rule):
        """Raises on every tensor."""

        def check(self, t, state):
            raise ZeroDivisionError("boom")

    said = []
    rules = RuleSet([Broken(), NaN(), ExplodingGradient()], log=lambda m, level: said.append(m))
    with pytest.warns(RuntimeWarning, match="rule Broken raised ZeroDivisionError"):
        found = judge_offline(rules, np.array([np.nan]), "fc.output", "output")
    assert found == {"NaN": 1.0}
    assert not rules.active[0].enabled and said and "Broken" in said[0]


def test_an_edit_the_rule_refuses_is_said_and_the_session_keeps_the_rule_as_it_was(watch):
    # What the Rules tab's edit dialog sends: every threshold, max_norm typed as -5.
    source = LiveSource(watch(mlp(), on_hit="record"))
    rule = next(r for r in source.rules()["rules"] if r["name"] == "ExplodingGradient")
    edit = {**rule["params"], "max_norm": -5.0}
    with pytest.raises(SourceError) as refused:
        source.set_rule(rule["id"], params=edit)
    assert str(refused.value) == "ExplodingGradient: max_norm must be a positive number, not -5.0"
    after = next(r for r in source.rules()["rules"] if r["id"] == rule["id"])
    assert after["params"] == rule["params"] and after["params"]["max_norm"] == 1e6
