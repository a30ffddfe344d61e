"""``RUN/launch.log``: the launcher's own output kept in the run folder (time-stamped lines),
the terminal output unchanged, a failure noted before it propagates."""

from __future__ import annotations

import re
import sys

import pytest

from astralight.launch.log import LaunchLog, current_launch_log, kept_in_launch_log

STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d "


def test_stdout_and_stderr_are_copied_with_a_time_stamp(tmp_path, capsys):
    path = tmp_path / "run" / "launch.log"
    with LaunchLog().open(path) as log:
        print("[launch] run folder: x")
        print("part", end="")
        print(" of a line")
        print("on stderr", file=sys.stderr)
        log.note("only in the file")
    print("after close")
    out = capsys.readouterr()
    assert out.out == "[launch] run folder: x\npart of a line\nafter close\n"
    assert out.err == "on stderr\n"
    lines = path.read_text().splitlines()
    assert [re.sub(STAMP, "", x) for x in lines] == [
        "[launch] run folder: x", "part of a line", "on stderr", "only in the file"]
    assert all(re.match(STAMP, x) for x in lines)


def test_a_second_launch_appends(tmp_path):
    path = tmp_path / "launch.log"
    for word in ("first", "second"):
        with LaunchLog().open(path):
            print(word)
    assert [x.split(" ", 2)[2] for x in path.read_text().splitlines()] == ["first", "second"]


def test_the_entry_point_keeps_its_failure_and_restores_the_streams(tmp_path):
    before = sys.stdout

    @kept_in_launch_log
    def run(run_dir):
        current_launch_log().open(run_dir / "launch.log")
        print("starting")
        raise RuntimeError("the dataflow exited during start-up")

    with pytest.raises(RuntimeError):
        run(tmp_path)
    assert sys.stdout is before
    text = (tmp_path / "launch.log").read_text()
    assert "starting" in text
    assert "[launch] failed: RuntimeError: the dataflow exited during start-up" in text
    current_launch_log().note("nowhere")  # outside a run: a no-op
