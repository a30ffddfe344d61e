"""Streamed weight downloads report their progress (a multi-GB snapshot must not look hung)."""

import logging

from astralight.dataflow.client import _DownloadProgress


def test_large_download_logs_percent_and_rate(caplog):
    caplog.set_level(logging.INFO, logger="astralight.dataflow.client")
    p = _DownloadProgress("policy v3 model.safetensors", total=200 << 20, every_s=0.0)
    for _ in range(4):
        p.add(50 << 20)
    p.done()
    lines = [r.getMessage() for r in caplog.records]
    assert lines and all("policy v3 model.safetensors" in line for line in lines)
    assert "25%" in lines[0] and "100%" in lines[-1] and "MB/s" in lines[-1]


def test_resumed_download_counts_from_what_it_had_and_small_files_are_silent(caplog):
    caplog.set_level(logging.INFO, logger="astralight.dataflow.client")
    p = _DownloadProgress("x", total=100 << 20, start=50 << 20, every_s=0.0)
    p.add(25 << 20)
    assert "75%" in caplog.records[-1].getMessage()
    caplog.clear()
    small = _DownloadProgress("y", total=1 << 20, every_s=0.0)
    small.add(1 << 20)
    small.done()
    assert not caplog.records
