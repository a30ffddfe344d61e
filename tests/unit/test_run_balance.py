"""The run folder's balance files: prose in ``balance.txt``, data in ``balance.jsonl``, windows
that neither skip nor repeat a version however late the launcher looks, the last window written
at the end, and a fixed pool's decision marked as advice only. A fake report fetch, no service."""

from __future__ import annotations

import json

from astralight.report.rundata import read_balance
from astralight.launch.balance import AUTOSCALE, FIXED, BalanceLog, window_line


def fake_fetch(calls):
    def fetch(window, last):
        calls.append((window, last))
        first = last - window + 1
        return {"versions": [first, last], "wait_fraction": 0.5, "produced": 10, "accepted": 8,
                "consumed": 6, "stale": 1, "model_id": "policy",
                "decision": {"action": "scale_up", "pool": 1, "target": 2, "reason": "starved"}}
    return fetch


def windows(run_dir):
    return [json.loads(x)["versions"] for x in (run_dir / "balance.jsonl").read_text().splitlines()]


def test_late_looks_skip_no_version_and_the_last_window_is_written(tmp_path):
    calls = []
    log = BalanceLog(tmp_path, fake_fetch(calls), every=10)
    for current in (3, 9, 10, 81, 92, 95):  # the version jumped 79 -> 81 between two looks
        log.poll(current)
    assert windows(tmp_path)[7:] == [[70, 79], [80, 89]]  # not 71..80 then 82..91
    log.finish(97)
    got = windows(tmp_path)
    assert got[0] == [0, 9] and got[-1] == [90, 97]
    assert all(b[0] == a[1] + 1 for a, b in zip(got, got[1:]))  # contiguous
    records = [json.loads(x) for x in (tmp_path / "balance.jsonl").read_text().splitlines()]
    assert [r["final"] for r in records] == [False] * 9 + [True]
    assert calls[-1] == (8, 97)
    lines = (tmp_path / "balance.txt").read_text().splitlines()
    assert len(lines) == 10 and not any(x.startswith("{") for x in lines)  # prose only
    assert lines[-1].startswith("versions 90..97 (final window")


def test_a_fixed_pool_decision_is_advice_only(tmp_path):
    BalanceLog(tmp_path, fake_fetch([]), every=2, pool_mode=FIXED).poll(2)
    line = (tmp_path / "balance.txt").read_text()
    assert "pool 1 -> scale_up 2 (starved); advice only: fixed pool" in line
    assert "nothing acts on it" in line
    record = json.loads((tmp_path / "balance.jsonl").read_text())
    assert record["advice_only"] is True and record["pool_mode"] == "fixed"
    report = {**record, "versions": [0, 1]}
    assert "the autoscaler acts" in window_line(report, AUTOSCALE)
    assert "advice only" not in window_line(report, AUTOSCALE)


def test_a_resumed_run_continues_after_its_last_window(tmp_path):
    BalanceLog(tmp_path, fake_fetch([]), every=5).poll(12)
    again = BalanceLog(tmp_path, fake_fetch([]), every=5)
    assert again.next_first == 10 and again.last["versions"] == [5, 9]
    again.poll(16)
    assert windows(tmp_path) == [[0, 4], [5, 9], [10, 14]]


def test_an_unavailable_report_is_asked_for_again(tmp_path):
    answers = iter([None, {"versions": [0, 1], "wait_fraction": 0.0, "produced": 0,
                           "accepted": 0, "consumed": 0, "stale": 0, "decision": {}}])
    log = BalanceLog(tmp_path, lambda window, last: next(answers), every=2)
    log.poll(3)
    assert not (tmp_path / "balance.jsonl").exists()
    log.poll(3)
    assert windows(tmp_path) == [[0, 1]]


def test_balance_off_writes_nothing(tmp_path):
    log = BalanceLog(tmp_path, fake_fetch([]), every=0)
    log.poll(50)
    log.finish(50)
    assert not (tmp_path / "balance.txt").exists()


def test_the_report_reads_balance_jsonl_and_an_older_balance_txt(tmp_path):
    BalanceLog(tmp_path, fake_fetch([]), every=2).poll(4)
    assert [r["versions"] for r in read_balance(tmp_path / "balance.jsonl")] == [[0, 1], [2, 3]]
    old = tmp_path / "old.txt"
    old.write_text("versions 0..1: wait fraction 50.0% ...\n" + json.dumps({"versions": [0, 1]})
                   + "\n")
    assert read_balance(old) == [{"versions": [0, 1]}]
