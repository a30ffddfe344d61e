"""A RaaS on a slow link: the toy recipe with the RaaS behind a shaped loopback proxy.

``astralight run`` starts the dataflow, a vLLM RaaS and a Lightning trainer; the RaaS reaches the
dataflow only through ``astralight.netshape`` at 20 Mbit/s and 50 ms RTT (leases, pushes and
weight downloads all cross it). Checked:

* the RaaS keeps producing: every version is trained on, and the final evaluation was generated
  by the final version's weights (pulled through the link);
* after the run, the weights vLLM holds (read back from the engine at shutdown) are bit-identical
  to the trainer's bf16 cast of its final weights (last.ckpt) and to the published manifest;
* the trainer does not feel the link (slow test): its step compute time with the RaaS behind the
  link stays within a generous factor of the time without it.

Helpers live in tests/benchmarks/bench_slow_link.py, which prints the same figures.
"""

from __future__ import annotations

import statistics

import pytest

from tests.benchmarks.bench_slow_link import run_toy

pytestmark = pytest.mark.vllm

LINK = (20.0, 50.0)  # Mbit/s, RTT ms


def _assert_run_ok(run: dict, versions: int, batch_size: int) -> None:
    summary = run["summary"]
    assert summary["versions"] == versions
    assert summary["samples_trained"] == versions * batch_size
    assert summary["eval"][str(versions)]["min_version"] == versions


def _assert_bit_identical(run: dict, versions: int) -> None:
    held = run["held"]
    assert held["version"] == versions and held["manifest_version"] == versions
    assert held["mismatched"] == []  # vLLM's weights == the published manifest's checksums
    assert held["held"] == held["expected"]
    assert run["checkpoint_bf16"] == held["held"]  # == the trainer's own bf16 cast
    assert len(held["held"]) == 25


def test_raas_behind_a_slow_link_keeps_producing_and_ends_bit_identical(tmp_path):
    versions, batch = 5, 16
    run = run_toy(tmp_path / "link", versions, batch, link=LINK)
    _assert_run_ok(run, versions, batch)
    _assert_bit_identical(run, versions)
    assert run["proxy"]["bytes_down"] > 0 and run["proxy"]["connections"] >= 2
    sync = run["held"]["sync"]
    assert sync["failures"] == 0 and sync["full_fallbacks"] == 0
    assert sync["full_pulls"] >= 1 and sync["refreshes"] >= 1
    routes = [e["route"] for e in sync["events"]]
    print(f"\nslow link: refreshes {sync['refreshes']} routes {routes} "
          f"bytes {sync['fetched_bytes']} pause {sync['pause_s_total']}s "
          f"raas samples/s {run['raas_samples_per_s']:.1f}")


@pytest.mark.slow
def test_trainer_step_time_is_unaffected_by_the_raas_link(tmp_path):
    versions, batch = 8, 64  # steps long enough (~0.07 s) for their medians to be stable
    with_link = run_toy(tmp_path / "link", versions, batch, link=LINK)
    without = run_toy(tmp_path / "direct", versions, batch, link=None)
    for run in (with_link, without):
        _assert_run_ok(run, versions, batch)
        _assert_bit_identical(run, versions)
    # step 0 pays one-time costs; compare the medians of the others
    a = statistics.median(with_link["scalars"]["perf/step_compute_s"][1:])
    b = statistics.median(without["scalars"]["perf/step_compute_s"][1:])
    print(f"\ntrainer step compute median: with link {a:.3f}s, without {b:.3f}s")
    assert a < 2.0 * b  # generous: the link is the RaaS's, the trainer's step must not wait on it
