"""The progress line's trouble report: error lines in the components' logs (counted from the
launch's start, the last one shown) and a rollout stream mostly dropped as stale."""

from __future__ import annotations

from astralight.launch.log_watch import ErrorWatch, StaleWatch


def test_errors_are_counted_from_the_launch_and_the_last_one_shown(tmp_path):
    raas, trainer = tmp_path / "raas-0.log", tmp_path / "trainer-policy.log"
    raas.write_text("2026-12-07 00:00:00,000 ERROR old: before this launch\n")  # a resumed run
    watch = ErrorWatch({"raas-0": raas, "trainer-policy": trainer, "dataflow": tmp_path / "no"})
    watch.poll()
    assert watch.text() == ""  # what was there before the launch does not count
    with open(raas, "a") as f:
        f.write("2026-12-07 00:00:01,000 INFO astralight.raas.service: raas up\n")
        for v in (4, 5):
            f.write(f"2026-12-07 00:00:02,000 ERROR astralight.raas.weight_sync: policy: loading "
                    f"v{v} into the engine failed (EngineConfigError: update_adapter: this engine "
                    f"was started without LoRA support); the engine stays on v3, retry in 2 s\n")
        f.write("2026-12-07 00:00:03,000 ERROR astralight.raas.weight_sync: policy: half a li")
    trainer.write_text("Traceback (most recent call last):\n  File \"x.py\", line 1\nKeyError: 'a'\n")
    watch.poll()
    text = watch.text()
    assert text.startswith(" | errors raas-0 2, trainer-policy 1 (last: policy: loading v5 into "
                           "the engine failed (EngineConfigError"), text
    assert text.endswith("...)") and len(text) < 160  # the long line is cut
    with open(raas, "a") as f:  # the unfinished line, finished: counted once
        f.write("ne\n")
    watch.poll()
    assert watch.counts == {"raas-0": 3, "trainer-policy": 1}
    assert "half a line" in watch.text()


def test_vllms_own_error_format_is_read_too(tmp_path):
    log = tmp_path / "raas-0.log"
    watch = ErrorWatch({"raas-0": log})
    log.write_text("(EngineCore pid=12) ERROR 12-07 00:01:02 [core.py:42] EngineCore failed\n"
                   "INFO: an ERRORS_FOUND counter name is not an error line\n")
    watch.poll()
    assert watch.text() == " | errors raas-0 1 (last: EngineCore failed)"


def test_more_than_half_stale_is_shown_and_warned_once_a_minute():
    stale = StaleWatch()
    stale.update(0, 0)
    stale.update(10, 9)  # too few rollouts to say anything
    assert stale.text() == "" and stale.warning(0.0) is None
    stale.update(640, 400)  # 400 of the last 640 stale
    assert stale.text() == " | stale 62% of the last 640 rollouts"
    warning = stale.warning(100.0)
    assert warning.startswith("[launch] warning: 62% of the last 640 rollouts were dropped as stale")
    assert "logs/raas-*.log" in warning and "dataflow.max_staleness" in warning
    assert stale.warning(130.0) is None and stale.warning(161.0) is not None
    stale.update(1280, 450)  # 50 of 640: healthy again
    assert stale.text() == "" and stale.warning(400.0) is None
