"""astralight/ARCHITECTURE.md names every route and report field the code has.

The design document lists the dataflow service's routes, the balance report's fields, the
launcher's additions to ``balance.jsonl`` and the fields of ``summary.json`` and of the short
line; these tests read each from the code (the FastAPI app, a live report, the summary builder)
and fail naming what the document lacks.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

import astralight
from astralight.dataflow.app import create_app
from astralight.dataflow.config import DataflowConfig
from astralight.launch.balance import BalanceLog, read_jsonl
from astralight.launch.stop import STOP_REASONS
from astralight.launch.summary import SHORT_KEYS, build_summary

DOC = Path(astralight.__file__).parent / "ARCHITECTURE.md"


@pytest.fixture(scope="module")
def doc() -> str:
    return DOC.read_text()


def fields_named(doc: str) -> set[str]:
    """Every ``word`` written in backticks in the document."""
    return set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", doc))


def missing(names, doc: str) -> list[str]:
    named = fields_named(doc)
    return sorted(n for n in names if n not in named)


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    return create_app(DataflowConfig(state_dir=str(tmp_path_factory.mktemp("df") / "state")),
                      token="")


def test_every_dataflow_route_is_in_the_document(app, doc):
    routes = [(m, r.path) for r in app.routes if isinstance(r, APIRoute) for m in r.methods]
    assert len(routes) >= 20
    absent = [f"{m} {p}" for m, p in routes if f"`{m} {p}`" not in doc]
    assert not absent, f"{DOC}: routes missing from the dataflow route tables: {absent}"


def test_every_balance_report_field_is_in_the_document(app, doc, tmp_path):
    with TestClient(app, base_url="http://127.0.0.1") as client:
        report = client.get("/v1/balance/policy").json()
    assert "decision" in report and "instances" in report
    absent = missing(list(report) + list(report["decision"]), doc)
    assert not absent, f"{DOC}: balance report fields missing: {absent}"

    log = BalanceLog(tmp_path, lambda window, last: report, every=1)
    log.finish(0)
    (record,) = read_jsonl(tmp_path / "balance.jsonl")
    absent = missing(set(record) - set(report), doc)
    assert not absent, f"{DOC}: balance.jsonl fields missing: {absent}"


def test_every_summary_field_is_in_the_document(doc):
    evals = {0: {"complete": True, "avg_at_k": 0.2, "tool_call_rate": 0.1},
             3: {"complete": True, "avg_at_k": 0.9, "tool_call_rate": 0.8}}
    summary = build_summary({"models": {"policy": {"current_version": 3}}}, evals, {}, "policy", 3)
    absent = missing(summary, doc)
    assert not absent, f"{DOC}: summary.json fields missing: {absent}"
    absent = missing([*SHORT_KEYS, *STOP_REASONS, "summary", "policies"], doc)
    assert not absent, f"{DOC}: short line fields or stop reasons missing: {absent}"
