"""A full volume under ``state_dir`` (issue 41, item 5): every write the dataflow's SQLite state
refuses is answered 507 naming ``state_dir`` (never a generic 500), logged once per episode of
the fault -- one line when it starts, one when writes succeed again (after a quiet spell: a
write that fits meanwhile does not end it) with the count refused meanwhile, no traceback per
request -- and a client retries such a refusal, saying the cause once.

The full disk is real SQLite: ``PRAGMA max_page_count`` pinned at the database's current size
makes SQLite itself refuse every write that needs a new page with ``SQLITE_FULL`` ("database or
disk is full"), exactly as a full volume does; raising it again is freeing space.
"""

from __future__ import annotations

import logging

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from astralight.dataflow.app import create_app
from astralight.dataflow.client import DataflowClient, DataflowError
from astralight.dataflow.client_credentials import INSTANCE_SECRET_HEADER
from astralight.dataflow.config import DataflowConfig
from astralight.protocol import Sample, decode, encode

MSGPACK = {"Content-Type": "application/msgpack"}
GROUP = 2
TOKENS = 2048  # each sample's arrays span several pages: every push needs new pages


def big_group(task_id: str) -> list[Sample]:
    """A valid group whose samples are big enough that storing them always allocates pages."""
    n = TOKENS
    return [Sample(task_id=task_id, sample_index=i, model_id="policy",
                   token_ids=np.arange(n, dtype=np.int32) % 1000,
                   logprobs=np.concatenate([np.zeros(2), np.full(n - 2, -0.5)]).astype(np.float32),
                   loss_mask=np.concatenate([np.zeros(2), np.ones(n - 2)]).astype(np.uint8),
                   versions=np.concatenate([np.full(2, -1), np.zeros(n - 2)]).astype(np.int32),
                   reward=float(i % 2), prompt_len=2) for i in range(GROUP)]


def post(http, path: str, body: dict, secret: str | None = None):
    headers = {**MSGPACK, **({INSTANCE_SECRET_HEADER: secret} if secret else {})}
    return http.post(path, content=encode(body), headers=headers)


def fill(conn) -> None:
    """The state's volume is full: no page beyond the database's current size."""
    pages = conn.execute("PRAGMA page_count").fetchone()[0]
    conn.execute(f"PRAGMA max_page_count={pages}")


def free(conn) -> None:
    conn.execute("PRAGMA max_page_count=1073741823")


def ours(records) -> list[logging.LogRecord]:
    """The service's own log records (not httpx's per-request lines)."""
    return [r for r in records if r.name.startswith("astralight")]


def state_lines(records, state_dir) -> list[logging.LogRecord]:
    return [r for r in records if str(state_dir) in r.getMessage()]


def test_a_full_state_dir_is_a_507_naming_it_and_one_log_line_per_episode(tmp_path, caplog):
    state = tmp_path / "state"
    app = create_app(DataflowConfig(state_dir=str(state), group_size=GROUP, lease_seconds=3600,
                                    max_body_bytes=8 << 20), token="")
    with TestClient(app, base_url="http://127.0.0.1", raise_server_exceptions=False) as http:
        reg = decode(post(http, "/v1/register", {"model_ids": ["policy"], "capacity": 4,
                                                 "instance_id": "raas-a", "meta": {}}).content)
        secret = reg["instance_secret"]
        tasks = decode(post(http, "/v1/lease", {"instance_id": "raas-a", "max_tasks": 2},
                            secret).content)["tasks"]
        assert len(tasks) == 2, tasks

        def push(task, many: bool = False):
            if many:
                return post(http, "/v1/push_many", {"instance_id": "raas-a", "items": [
                    {"task_id": task.task_id, "samples": big_group(task.task_id)}]}, secret)
            return post(http, "/v1/push", {"instance_id": "raas-a", "task_id": task.task_id,
                                           "samples": big_group(task.task_id)}, secret)

        store = app.state.dataflow.store
        now = [1000.0]
        store.refusals.clock = lambda: now[0]  # the episode's quiet spell, without waiting
        fill(store.conn)
        caplog.clear()
        with caplog.at_level(logging.INFO):
            for _ in range(100):
                r = push(tasks[0])
                assert r.status_code == 507, (r.status_code, r.text[:300])
                err = r.json()
                assert err["field"] == "state_dir", err
                assert str(state) in err["error"] and "full" in err["error"], err
                assert "free space" in err["error"], err  # the fix
            r = push(tasks[1], many=True)
            assert r.status_code == 507 and r.json()["field"] == "items[0].state_dir", r.text
            during = ours(caplog.records)
            # a write that fits meanwhile (as when SQLite reuses its WAL) does not end it
            free(store.conn)
            now[0] += 5
            assert push(tasks[0]).status_code == 200
            fill(store.conn)
            assert push(tasks[1]).status_code == 507
            flapping = ours(caplog.records)[len(during):]
            # room again: the first write after a quiet spell ends the episode
            free(store.conn)
            now[0] += store.refusals.quiet_s + 1
            r = push(tasks[1])
            assert r.status_code == 200 and decode(r.content)["accepted"] == GROUP
        after = ours(caplog.records)[len(during) + len(flapping):]
        assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
        stats = http.get("/v1/stats").json()
    # 101 refused writes: one line, no traceback, nothing else logged about them
    assert [r.levelno for r in during] == [logging.ERROR], [r.getMessage() for r in during]
    line = during[0].getMessage()
    assert str(state) in line and "507" in line and "database or disk is full" in line, line
    assert during[0].exc_info is None and "\n" not in line
    assert flapping == [], [r.getMessage() for r in flapping]
    # writes work again: one line with the count refused meanwhile
    back = state_lines(after, state)
    assert len(back) == 1 and "succeed again" in back[0].getMessage(), \
        [r.getMessage() for r in after]
    assert "102 write(s) were refused" in back[0].getMessage(), back[0].getMessage()
    assert stats["clients"]["testclient"]["failures_5xx"] == 102  # still counted per client
    assert stats["models"]["policy"]["samples_accepted"] == 2 * GROUP


def _client(handler, retry_s: float, url: str) -> DataflowClient:
    """A real client whose transport is ``handler`` (its own ``url``: the episodes it logs are
    per URL and process)."""
    client = DataflowClient(url, token="", retry_s=retry_s)
    client._http.close()
    client._http = httpx.Client(base_url=client.url, transport=httpx.MockTransport(handler))
    return client


FULL = {"error": "state_dir: state_dir /run/state is full (database or disk is full); nothing "
                 "of this request was stored: free space on that volume and retry",
        "field": "state_dir"}


def test_a_client_retries_a_full_state_dir_and_says_why_once(caplog):
    calls = []

    def handler(request):
        calls.append(request.url.path)
        if len(calls) <= 3:
            return httpx.Response(507, json=FULL)
        return httpx.Response(200, content=encode({"returned": 0}), headers=MSGPACK)

    client = _client(handler, retry_s=30.0, url="http://dataflow-retries.test")
    with caplog.at_level(logging.INFO, logger="astralight.dataflow.client"):
        assert client.return_tasks("raas-a", []) == {"returned": 0}
    assert len(calls) == 4  # three refusals retried, then answered
    lines = [r.getMessage() for r in ours(caplog.records)]
    assert len(lines) == 2, lines  # the cause once, then that it answers again
    assert "507" in lines[0] and "/run/state is full" in lines[0] and "free space" in lines[0]
    assert "answers again after 3 call(s) refused" in lines[1], lines[1]


def test_a_client_gives_up_after_retry_s_with_the_cause_and_never_retries_other_507s(caplog):
    calls = []

    def handler(request):
        calls.append(request.url.path)
        if request.url.path == "/v1/weights/policy/1/model.safetensors":
            return httpx.Response(507, json={"error": "weight store /w is full", "field": "disk"})
        return httpx.Response(507, json=FULL)

    client = _client(handler, retry_s=0.35, url="http://dataflow-gives-up.test")
    with caplog.at_level(logging.INFO, logger="astralight.dataflow.client"):
        with pytest.raises(DataflowError) as refused:
            client.return_tasks("raas-a", [])
    assert (refused.value.status, refused.value.field) == (507, "state_dir")
    assert "/run/state is full" in str(refused.value)
    assert len(calls) >= 2  # retried within retry_s before giving up
    said = [r.getMessage() for r in ours(caplog.records)]
    assert len(said) == 1 and "cannot store anything" in said[0], said  # said once
    calls.clear()
    with pytest.raises(DataflowError) as weights:  # the weight store's 507: not retried
        client.upload_weight_file("policy", 1, "model.safetensors", b"x")
    assert weights.value.field == "disk" and len(calls) == 1
