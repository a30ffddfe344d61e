"""Every warm start trains on one torch thread unless told otherwise: two OpenMP threads
spin-wait for each other on a loaded two-core machine (380 s against 42 s measured for the toy's
warm start), and a recipe that forgets ``num_threads: 1`` must not pay that."""

from __future__ import annotations

import inspect

import pytest

from astralight.tasks import (arithmetic_warmstart, calculator_warmstart, chat_warmstart,
                              search_warmstart, sft_warmstart, solver_verifier_warmstart,
                              tool_warmstart)

BUILDERS = [arithmetic_warmstart.build_toy_policy, chat_warmstart.build_chat_policy,
            search_warmstart.build_search_policy, sft_warmstart.build_sft_policy,
            solver_verifier_warmstart.build_toy_verifier, solver_verifier_warmstart.build_toy_solver,
            solver_verifier_warmstart.build_toy_solver_verifier, tool_warmstart.build_tool_policy,
            calculator_warmstart.warm_start_calculator]


@pytest.mark.parametrize("builder", BUILDERS, ids=lambda b: b.__name__)
def test_warm_starts_default_to_one_thread(builder):
    assert inspect.signature(builder).parameters["num_threads"].default == 1
