"""Counters are a closed set: the dataflow counts only declared names, so a typo in a counter
name raises instead of silently starting a counter no report reads."""

from __future__ import annotations

import pytest

from astralight.agents.stats import COUNTER_NAMES
from astralight.dataflow.config import DataflowConfig
from astralight.dataflow.core import Dataflow
from astralight.dataflow.counters import COUNTERS, KNOWN, check_counter


def test_declared_names_pass_through():
    for name in (*COUNTERS, *COUNTER_NAMES):
        assert check_counter(name) == name
    assert KNOWN == set(COUNTERS) | set(COUNTER_NAMES)


def test_undeclared_name_is_refused():
    with pytest.raises(ValueError, match="samples_acepted"):
        check_counter("samples_acepted")


def test_dataflow_bump_refuses_a_typo_and_counts_nothing(tmp_path):
    flow = Dataflow(DataflowConfig(state_dir=str(tmp_path / "state")))
    try:
        with flow.lock, flow.store.tx():
            flow._bump("policy", "samples_accepted", 2)
        with pytest.raises(ValueError, match="unknown counter 'samples_acepted'"):
            with flow.lock, flow.store.tx():
                flow._bump("policy", "samples_acepted")
        counted = flow.stats()["models"]["policy"]
        assert counted["samples_accepted"] == 2
        assert "samples_acepted" not in counted
    finally:
        flow.close()
