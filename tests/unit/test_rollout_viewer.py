"""The rollout viewer (``astralight report RUN --viewer`` / ``--serve``) on a run folder whose
dataflow state is written by the real dataflow core: two policies, two versions, a tool-calling
episode with a failed call, a completion holding markup, the project's chat tokenizer in
``RUN/models/init``.

What is checked: the decoded texts, that model output is escaped (shown as text), the tokens'
loss-mask and log-prob attributes, reward and advantage, the tool call, its result and the tool
error, the filters (a policy filter naming both policies), the caps, that the DB is read
read-only (nothing in the state folder changes) while the run is live (new samples show on the
next load), the token-id fallback without a tokenizer, that undecodable blobs (a pickle) are
refused, and the ``--serve`` route on 127.0.0.1.
"""

from __future__ import annotations

import html
import os
import pickle
import re
import shutil
import sqlite3
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import yaml

from astralight.dataflow.config import DataflowConfig
from astralight.dataflow.core import Dataflow
from astralight.protocol import Sample
from astralight.report import main as report_main
from astralight.report.viewer import (VIEWER_FILE, Detokenizer, ViewerCaps, load_rollouts,
                                      make_server, viewer_html, write_viewer)
from tests.unit.dataflow_fakes import publish

PROMPT = "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": "x"}}</tool_call><|im_end|>'
RESULT = ("\n<|im_start|>user\n<tool_response>\nerror: b must be a number\n</tool_response>"
          "<|im_end|>\n<|im_start|>assistant\n")
EVIL = "<script>alert(1)</script><img src=x onerror=alert(2)> The answer is 5."
POLICIES = ["solver", "verifier"]


@pytest.fixture(scope="module")
def tokenizer():
    from astralight.trainer.tinymodel import build_chat_tokenizer

    return build_chat_tokenizer()


def make_sample(tok, task_id: str, index: int, model_id: str, turns: list[tuple[str, str]],
                reward: float, version: int, metadata: dict) -> Sample:
    """A sample of the prompt then ``turns`` (``model``: generated, loss mask 1; ``env``: tool
    results, mask 0), with log-probs alternating likely (-0.05) and unlikely (-5.0)."""
    ids = tok.encode(PROMPT, add_special_tokens=False)
    prompt_len = len(ids)
    mask = [0] * prompt_len
    for kind, text in turns:
        t = tok.encode(text, add_special_tokens=False)
        ids += t
        mask += [1 if kind == "model" else 0] * len(t)
    lps = [(-0.05 if j % 2 else -5.0) if m else 0.0 for j, m in enumerate(mask)]
    return Sample(task_id=task_id, sample_index=index, model_id=model_id,
                  token_ids=np.array(ids, np.int32), logprobs=np.array(lps, np.float32),
                  loss_mask=np.array(mask, np.uint8),
                  versions=np.array([version if m else -1 for m in mask], np.int32),
                  reward=reward, prompt_len=prompt_len, group_index=index,
                  metadata={"temperature": 1.0, **metadata})


def push_round(flow: Dataflow, iid: str, tok, version: int, tag: str) -> list[str]:
    """One task per lease: per policy, a tool episode whose call failed (reward 0) and an answer
    holding markup (reward 1)."""
    task_ids = []
    for task in flow.lease(iid, 1):
        samples = []
        for m in POLICIES:
            base = len(samples)
            samples.append(make_sample(
                tok, task.task_id, base, m, [("model", CALL), ("env", RESULT),
                                             ("model", f"I give up {tag}.<|im_end|>")],
                0.0, version,
                {"turns": 2, "end": "answer", "tool_calls": 1, "answer": "",
                 "tool_errors": {"malformed": 0, "bad_arguments": 1}}))
            samples.append(make_sample(
                tok, task.task_id, base + 1, m, [("model", f"{EVIL} {tag}<|im_end|>")], 1.0,
                version,
                {"turns": 1, "end": "answer", "tool_calls": 0, "answer": EVIL,
                 "tool_errors": {"malformed": 0, "bad_arguments": 0}}))
        flow.push(iid, task.task_id, samples)
        task_ids.append(task.task_id)
    return task_ids


def visible(page: str) -> str:
    """The page's text as a browser shows it (tags dropped, entities decoded)."""
    return html.unescape(re.sub(r"<[^>]*>", "", page))


class Flow:
    """The fixture's dataflow core; ``close()`` (the run finishes) may come before teardown."""

    def __init__(self, flow: Dataflow):
        self.flow, self.closed = flow, False

    def __getattr__(self, name):
        return getattr(self.flow, name)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.flow.close()


@pytest.fixture
def live_run(tmp_path, tokenizer):
    """A run folder while its dataflow is still running (the state's WAL open): version 0 and
    version 1 samples of two policies. Yields ``(run_dir, flow, iid, tokenizer)``; ``flow.close()``
    finishes the run."""
    run = tmp_path / "run"
    tokenizer.save_pretrained(str(run / "models" / "init"))
    (run / "configs").mkdir(parents=True)
    (run / "configs" / "trainer-solver.yaml").write_text(yaml.safe_dump({"model": {
        "class_path": "astralight.policy.GRPOPolicy",
        "init_args": {"model_path": "/moved/away/run/models/init", "model_id": "solver"}}}))
    flow = Flow(Dataflow(DataflowConfig(state_dir=str(run / "dataflow"), model_ids=POLICIES,
                                        group_size=2)))
    iid = flow.register(POLICIES, 8, None, {})["instance_id"]
    try:
        push_round(flow, iid, tokenizer, 0, "v0")
        for m in POLICIES:
            publish(flow.flow, 1, m)
        push_round(flow, iid, tokenizer, 1, "v1")
        yield run, flow, iid, tokenizer
    finally:
        flow.close()


def state_files(run: Path) -> dict[str, tuple[int, int]]:
    folder = run / "dataflow"
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()
            if p.is_file() and not p.name.endswith(("-shm", ".commits"))}


def test_viewer_page_shows_texts_tokens_rewards_tools_and_filters(live_run):
    run, flow, _, _ = live_run
    flow.close()  # a finished run: the state checkpointed, no WAL
    before = state_files(run)
    path = write_viewer(run)
    assert path == run / "report" / VIEWER_FILE
    assert state_files(run) == before, "the viewer changed the dataflow state folder"
    page = path.read_text()
    text = visible(page)

    # decoded with RUN/models/init (the trainer config's path moved away: found under models/)
    assert "decoded with models/init/tokenizer.json" in text
    assert "The answer is 5. v1" in text and "I give up v0." in text
    assert "What is 2+3?" in text
    # model output is text, never markup: the only <script> is the page's own
    assert page.count("<script>") == 1 and "<script>alert" not in page
    assert "<img src=x" not in page and "onerror=alert(2)" not in page.replace(
        "&lt;img src=x onerror=alert(2)&gt;", "")
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page  # the metadata's answer, escaped
    assert "<script>alert(1)</script><img src=x onerror=alert(2)> The answer is 5." in text
    assert "Content-Security-Policy" in page and "script-src 'sha256-" in page

    # per version and task group, newest first; both policies
    for m in POLICIES:
        for v in (0, 1):
            assert f'data-model="{m}" data-version="{v}"' in page
    assert page.index('data-model="solver" data-version="1"') < page.index(
        'data-model="solver" data-version="0"')
    assert page.count('<details class="group"') == 4
    assert page.count('<article class="sample"') == 8

    # tokens: loss mask and behaviour log-prob attributes, log-prob buckets, the colour toggle
    assert re.search(r'<span class="g b0" data-m="1" data-lp="-0\.05">', page)
    assert re.search(r'<span class="g b4" data-m="1" data-lp="-5">', page)
    assert '<span class="p" data-m="0">' in page and '<span class="e" data-m="0">' in page
    assert 'name="colour" value="mask"' in page and 'name="colour" value="lp"' in page

    # reward and advantage (the dataflow's, from the group: rewards 0 and 1)
    samples = load_rollouts(run / "dataflow" / "dataflow.db").samples
    assert {round(s.sample.advantage, 3) for s in samples} == {-1.0, 1.0}
    assert 'reward <b class="rw">1.000</b>' in page and 'reward <b class="rw">0.000</b>' in page
    assert 'advantage <b class="adv">+1.000</b>' in page
    assert 'advantage <b class="adv">-1.000</b>' in page

    # the tool call, its result, and the tool error (from the metadata)
    assert "<td>add</td>" in page
    assert "error: b must be a number" in text
    assert page.count('data-errors="bad_arguments"') == 4
    assert "errors: bad_arguments &times;1" in page

    # the filters: policy (both), reward range, tool error kinds, state; the count JS fills
    for ident in ("f-policy", "f-rmin", "f-rmax", "f-error", "f-state", "shown-count"):
        assert f'id="{ident}"' in page
    policy = re.search(r'<select id="f-policy">(.*?)</select>', page).group(1)
    assert '<option value="solver">solver</option>' in policy
    assert '<option value="verifier">verifier</option>' in policy
    errors = re.search(r'<select id="f-error">(.*?)</select>', page).group(1)
    assert '<option value="bad_arguments">bad_arguments (4)</option>' in errors
    assert '<option value="agent_error">agent_error (0)</option>' in errors
    assert 'data-reward="1.0"' in page and 'data-reward="0.0"' in page


def test_caps_bound_versions_samples_and_tokens(live_run):
    run, flow, _, _ = live_run
    page = viewer_html(run, caps=ViewerCaps(versions=1, samples=1, tokens=40))
    assert 'data-version="1"' in page and 'data-version="0"' not in page
    assert page.count('<article class="sample"') == 2  # one per policy
    assert "tokens not shown ...]" in page
    assert "the last 1 versions of each policy (solver: 1 of 2 versions" in visible(page)
    with pytest.raises(ValueError, match="--viewer-samples"):
        ViewerCaps(samples=0)


def test_a_live_run_shows_new_samples_on_the_next_load_and_is_not_written(live_run, tmp_path):
    run, flow, iid, tok = live_run
    db = run / "dataflow" / "dataflow.db"
    assert Path(f"{db}-wal").exists(), "the fixture's run is live: its WAL is open"
    first = viewer_html(run)
    new = push_round(flow, iid, tok, 1, "late")
    second = viewer_html(run)
    assert new and new[0] not in first
    assert f"<code>{new[0]}</code>" in second and "The answer is 5. late" in visible(second)
    # the read-only connection could not write, even if asked to
    from astralight.report.rundata import ReadOnlyStore

    store = ReadOnlyStore(db)
    try:
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            store.conn.execute("DELETE FROM samples")
    finally:
        store.close()


def test_without_a_tokenizer_the_page_shows_token_ids(live_run, tmp_path, tokenizer):
    run, _, _, _ = live_run
    empty = tmp_path / "no-tokenizer"
    empty.mkdir()
    out = write_viewer(run, tmp_path / "out", caps=ViewerCaps(versions=1),
                       tokenizer=empty)
    page = out.read_text()
    assert "token ids shown (no tokenizer files in" in page
    ids = tokenizer.encode("The answer", add_special_tokens=False)
    assert " ".join(str(i) for i in ids) in visible(page)
    assert "<td>add</td>" not in page  # no text: no tool calls parsed (the metadata's count stays)


def test_undecodable_blobs_are_left_out_never_unpickled(live_run, tmp_path):
    run, flow, _, _ = live_run
    flow.close()
    copy = tmp_path / "copy.db"
    shutil.copy(run / "dataflow" / "dataflow.db", copy)
    con = sqlite3.connect(copy)
    con.execute("INSERT INTO samples(task_id, model_id, sample_index, min_version, reward, state,"
                " blob, created) VALUES('evil', 'solver', 0, 1, 0, 'queued', ?, 0)",
                (pickle.dumps(os.system),))
    con.commit()
    con.close()
    got = load_rollouts(copy)
    assert len(got.samples) == 8
    assert any("1 stored samples do not decode" in n and "not valid msgpack" in n
               for n in got.notes)


class ByteTokenizer:
    """A byte-level stand-in: ids are UTF-8 bytes, so one character can take two tokens."""

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=False):
        return bytes(ids).decode("utf-8", errors="replace")

    def batch_decode(self, seqs, skip_special_tokens=False, clean_up_tokenization_spaces=False):
        return [self.decode(s) for s in seqs]


class SpaceDroppingTokenizer(ByteTokenizer):
    """SentencePiece-like: word pieces carry their leading space, dropped at the text's start."""

    WORDS = ["\u2581hello", "\u2581world", "!"]

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=False):
        return "".join(self.WORDS[i] for i in ids).replace("\u2581", " ").lstrip(" ")


def test_token_pieces_add_up_to_the_decoded_text():
    detok = Detokenizer(ByteTokenizer(), "bytes")
    ids = list("né à".encode())
    pieces = detok.pieces(ids)
    assert len(pieces) == len(ids) and "".join(pieces) == "né à"
    assert "\ufffd" not in "".join(pieces)
    assert pieces[1:3] == ["", "é"]  # the first byte of é shows nothing, the second all of it
    assert detok.pieces(list("ab".encode())) == ["a", "b"]
    assert detok.pieces(list("é".encode())[:1]) == ["\ufffd"]  # cut off: shown as decoded
    spaced = Detokenizer(SpaceDroppingTokenizer(), "words")
    assert spaced.pieces([0, 1, 2, 0]) == ["hello", " world", "!", " hello"]


def test_report_viewer_flag_writes_the_page(live_run, capsys):
    run, flow, _, _ = live_run
    flow.close()
    assert report_main([str(run), "--viewer", "--viewer-versions", "1"]) == 0
    assert f"rollout viewer written to {run / 'report' / VIEWER_FILE}" in capsys.readouterr().out
    assert (run / "report" / "summary.txt").is_file()  # the report as before
    assert 'data-version="0"' not in (run / "report" / VIEWER_FILE).read_text()
    with pytest.raises(SystemExit):
        report_main([str(run), "--viewer", "--viewer-tokens", "0"])


def _get(url: str, host: str | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Host": host} if host else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_serve_answers_on_loopback_with_the_page_regenerated_each_load(live_run):
    run, flow, iid, tok = live_run
    server = make_server(run, port=0)
    assert server.server_address[0] == "127.0.0.1"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        status, page = _get(server.url)
        assert status == 200 and "The answer is 5. v1" in visible(page)
        new = push_round(flow, iid, tok, 1, "served")
        status, page = _get(server.url + VIEWER_FILE)
        assert status == 200 and f"<code>{new[0]}</code>" in page
        assert _get(server.url + "other")[0] == 404
        # a page of another site resolving its name to 127.0.0.1 (DNS rebinding) gets nothing
        assert _get(server.url, host=f"evil.example:{server.port}")[0] == 421
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_serve_command_prints_its_loopback_url(live_run):
    run, flow, _, _ = live_run
    proc = subprocess.Popen([sys.executable, "-m", "astralight.cli", "report", str(run),
                             "--serve", "--port", "0", "--viewer-samples", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        m = re.search(r"at (http://127\.0\.0\.1:\d+/)", line)
        assert m, line + proc.stderr.read() if proc.poll() is not None else line
        status, page = _get(m.group(1))
        assert status == 200 and page.count('<article class="sample"') == 8  # 2 x 2 x 2
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert not (run / "report").exists()  # --serve writes nothing
