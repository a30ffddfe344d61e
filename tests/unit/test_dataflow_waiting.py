"""A dataflow client waiting for a service that is not there: it says so every few seconds,
naming the address, and stops waiting at once when the process is asked to stop (its ``stop``
event, the process-wide :data:`STOP_WAITING` flag, or SIGTERM through :func:`wake_on_sigterm`).

Nothing listens on the port these clients call: a connection is refused at once, so every
retry loop here runs for real, only against nothing."""

from __future__ import annotations

import signal
import threading

import pytest

from astralight.dataflow import client as client_mod
from astralight.dataflow.client import (STOP_WAITING, DataflowClient, DataflowStopped,
                                        DataflowUnreachable, wake_on_sigterm)
from tests.conftest import free_port


@pytest.fixture
def url():
    return f"http://127.0.0.1:{free_port()}"


@pytest.fixture(autouse=True)
def _no_stop_left_behind():
    STOP_WAITING.clear()
    yield
    STOP_WAITING.clear()


def _waiting_lines(caplog, url):
    return [r.getMessage() for r in caplog.records
            if r.getMessage().startswith(f"waiting for the dataflow at {url} (")]


def test_a_retrying_call_says_every_few_seconds_that_it_waits_and_where(url, caplog,
                                                                        monkeypatch):
    monkeypatch.setattr(client_mod, "WAIT_LOG_AFTER_S", 0.0)
    monkeypatch.setattr(client_mod, "WAIT_LOG_EVERY_S", 0.2)
    client = DataflowClient(url, retry_s=1.0)
    with caplog.at_level("WARNING", logger="astralight.dataflow.client"):
        with pytest.raises(DataflowUnreachable) as info:
            client.info()
    client.close()
    assert not isinstance(info.value, DataflowStopped)  # it ran out of retry_s
    lines = _waiting_lines(caplog, url)
    assert len(lines) >= 2, lines  # not one line at the end: lines while it waits
    assert "ConnectError" in lines[0] and "retrying for up to 1 s" in lines[0]
    # a warning: a trainer configures no logging, and Python's last-resort handler prints
    # warnings only
    assert all(r.levelname == "WARNING" for r in caplog.records if r.getMessage() in lines)


def test_a_short_retry_never_logs(url, caplog):
    client = DataflowClient(url, retry_s=0.3)  # below WAIT_LOG_AFTER_S: keep-alives, probes
    with pytest.raises(DataflowUnreachable):
        client.info()
    client.close()
    assert not _waiting_lines(caplog, url)


def test_a_stop_event_set_during_the_wait_ends_it_with_dataflow_stopped(url):
    stop = threading.Event()
    client = DataflowClient(url, retry_s=60.0, stop=stop)
    timer = threading.Timer(0.3, stop.set)
    timer.start()
    try:
        with pytest.raises(DataflowStopped) as info:
            client.info()
    finally:
        timer.cancel()
        client.close()
    assert url in str(info.value) and "stop requested" in str(info.value)
    assert isinstance(info.value, DataflowUnreachable)  # code handling unreachable handles it


def test_the_process_wide_flag_stops_every_client_without_a_retry(url, monkeypatch):
    attempts = []
    client = DataflowClient(url, retry_s=60.0)
    real = client._http.request

    def counting(*args, **kwargs):
        attempts.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(client._http, "request", counting)
    STOP_WAITING.set("SIGTERM received")
    with pytest.raises(DataflowStopped, match="SIGTERM received"):
        client.info()
    client.close()
    assert len(attempts) == 1  # the first attempt is still made (a reachable service answers)


def test_sigterm_sets_the_flag_and_a_handler_chaining_it_stays_in_charge():
    """Installed alone, the handler sets the flag and then does what SIGTERM did before (here a
    recorder; the default action would end the process). Chained by another handler (Lightning's,
    during fit, which stops the fit at the next step), it only sets the flag."""
    original = signal.getsignal(signal.SIGTERM)
    before, chained = [], []
    try:
        signal.signal(signal.SIGTERM, lambda s, f: before.append(s))
        assert wake_on_sigterm() is True
        signal.raise_signal(signal.SIGTERM)
        assert STOP_WAITING.is_set() and STOP_WAITING.reason == "SIGTERM received"
        assert before == [signal.SIGTERM]  # the previous handler still ran

        STOP_WAITING.clear()
        ours = signal.getsignal(signal.SIGTERM)

        def lightning(signum, frame):  # what Lightning's _HandlersCompose does
            chained.append(signum)
            ours(signum, frame)

        signal.signal(signal.SIGTERM, lightning)
        signal.raise_signal(signal.SIGTERM)
        assert STOP_WAITING.is_set() and chained == [signal.SIGTERM]
        assert before == [signal.SIGTERM]  # not called again: the chaining handler acts
    finally:
        signal.signal(signal.SIGTERM, original)
        client_mod._PREVIOUS_SIGTERM.clear()


def test_wake_on_sigterm_does_nothing_off_the_main_thread():
    original = signal.getsignal(signal.SIGTERM)
    result = []
    thread = threading.Thread(target=lambda: result.append(wake_on_sigterm()))
    thread.start()
    thread.join()
    assert result == [False] and signal.getsignal(signal.SIGTERM) is original


def test_a_pull_waiting_for_the_dataflow_gives_up_when_the_trainer_wants_to_stop(url):
    """``astralight fit`` turns SIGTERM into ``trainer.should_stop`` (finish the step, end the
    fit): a pull already waiting for an unreachable dataflow must not wait out its retry_s."""
    from types import SimpleNamespace

    from astralight.datamodules import RolloutDataModule

    dm = RolloutDataModule(url, model_id="policy", batch_size=2)
    trainer = SimpleNamespace(should_stop=False, received_sigterm=False, global_rank=0,
                              callbacks=[])
    dm.trainer = trainer
    assert dm.client.retry_s == 60.0 and not dm.client.stop.is_set()
    timer = threading.Timer(0.3, setattr, args=(trainer, "should_stop", True))
    timer.start()
    try:
        with pytest.raises(DataflowStopped, match=f"stopped waiting for the dataflow at {url}"):
            dm.stream(lazy=False).pull()
    finally:
        timer.cancel()
        dm.teardown("fit")
