"""The departures-from-parity table: seeds merged across invocations, interpolation on each
seed's own eval points, no mean where a seed did not get there, differences from parity."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks import departures_table as table


def _write(path, runs):
    """A bench_vs_trl JSON output holding ``runs``: ``{seed: [[t, samples, acc], ...]}``."""
    path.write_text(json.dumps({"astra_runs": [
        {"seed": s, "curve": c, "summary": {"samples_trained": c[-1][1]}}
        for s, c in runs.items()]}))
    return str(path)


def test_rows_merge_seeds_across_invocations_and_difference_from_parity(tmp_path, capsys):
    parity = [_write(tmp_path / "p0.json", {0: [[0, 0, 0.0], [100, 1000, 0.4]]}),
              _write(tmp_path / "p12.json", {1: [[0, 0, 0.0], [100, 1000, 0.2]],
                                             2: [[0, 0, 0.0], [100, 1000, 0.6]]})]
    fast = _write(tmp_path / "f.json", {0: [[0, 0, 0.0], [100, 4000, 0.8]],
                                        1: [[0, 0, 0.0], [100, 4000, 0.8]]})
    assert table.main(["--samples", "500,1000", "--times", "50,100", "--json",
                       "--row", "parity=" + ",".join(parity), "--row", f"fast={fast}"]) == 0
    out = json.loads(capsys.readouterr().out)
    p, f = out["rows"]
    assert p["seeds"] == [0, 1, 2]
    assert p["at_samples"][1]["mean"] == pytest.approx(0.4)
    assert (p["at_samples"][1]["low"], p["at_samples"][1]["high"]) == (0.2, 0.6)
    assert p["at_seconds"][0]["mean"] == pytest.approx(0.2)  # halfway to 0.4 at 50 s
    # 1,000 samples are a quarter of the fast row's 4,000: 0.2; at 100 s it is at 0.8
    assert f["at_samples"][1]["mean"] == pytest.approx(0.2)
    assert f["cost_per_sample"] == pytest.approx(-0.2)
    assert f["gain_per_second"] == pytest.approx(0.4)


def test_no_mean_where_a_seed_had_not_trained_that_many_samples(tmp_path, capsys):
    a = _write(tmp_path / "a.json", {0: [[0, 0, 0.1], [100, 2000, 0.5]],
                                     1: [[0, 0, 0.1], [100, 800, 0.3]]})
    assert table.main(["--samples", "1000", "--times", "100", "--row", f"a={a}"]) == 0
    md = capsys.readouterr().out
    row = md.splitlines()[2].split("|")
    assert row[3].strip() == "-"  # seed 1 stopped at 800 samples
    assert row[4].strip() == "0.40"


def test_a_seed_in_two_files_and_a_bad_row_are_refused(tmp_path):
    a = _write(tmp_path / "a.json", {0: [[0, 0, 0.1], [100, 2000, 0.5]]})
    b = _write(tmp_path / "b.json", {0: [[0, 0, 0.1], [100, 2000, 0.5]]})
    with pytest.raises(SystemExit):
        table.main(["--row", f"a={a},{b}"])
    with pytest.raises(SystemExit):
        table.main(["--row", "nofiles"])
    with pytest.raises(SystemExit):
        table.main(["--row", f"a={a}", "--samples", "1000", "--per-sample-at", "2000"])
