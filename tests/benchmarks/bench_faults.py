"""Benchmark: the toy run survives faults with nothing lost and nothing trained twice.

    python tests/benchmarks/bench_faults.py --json
    python tests/benchmarks/bench_faults.py --json --scenarios dataflow_kill,garbage_raas --versions 10

Each scenario (see :mod:`tests.fault_harness`, which does the work) starts the toy recipe's three
processes by hand on loopback (dataflow, vLLM RaaS, Lightning trainer; configs from
``astralight.launch.export_configs``), injects one fault once the policy reaches ``--fault-at``,
lets the run finish its ``--versions`` and audits the dataflow's SQLite state
(:mod:`astralight.dataflow.audit`, read-only). Scenarios: ``dataflow_kill`` (kill -9, restart on
the same state and port), ``raas_kill`` (kill -9, a new RaaS), ``trainer_kill`` (kill -9 one step
past a checkpoint, restart with ``--ckpt_path last.ckpt``), ``partition`` (RaaS <-> dataflow
through a proxy that drops every byte for ``--partition-s``, longer than a lease), ``disk_full``
(a tmpfs under the weight store, full until ``--disk-full-refusals`` uploads were refused),
``garbage_raas`` (a RaaS pushing malformed samples), ``dataflow_fresh_state`` (kill -9 the
dataflow and the trainer, restart the dataflow on a new ``state_dir`` on the same port and a
fresh trainer: a new run; the RaaS holding the old run's weights must exit, and a new one is
started), ``state_disk_full`` (a tmpfs under the whole ``state_dir``: the SQLite state and the
weight store, full until ``--disk-full-refusals`` requests were refused with 507 naming
``state_dir``; every client retries them).

One JSON line per scenario on stdout (progress on stderr):

* ``scenario``; ``completed``: the trainer exited 0 with the dataflow at the target version;
* ``tasks_issued``, ``samples_accepted``, ``samples_trained``, ``samples_lost`` (must be 0),
  ``duplicates_trained`` (must be 0), ``balanced``: the audit's figures (definitions in
  :mod:`astralight.dataflow.audit`); ``samples_rolled_back``: samples of batches acked after
  the checkpoint a killed trainer resumed from (their training was redone);
* ``cross_run_samples`` (``dataflow_fresh_state``, must be 0): samples the new run accepted from
  the RaaS that held the old run's weights; ``detail.old_run``: the old state's audit as the kill
  left it (its ``samples_lost`` must be 0 too), ``detail.raas_said``: the RaaS's line;
* ``recovery_s``: seconds from the fault being cleared (the kill -- the restart follows at once;
  the link healed; the disk freed; the last garbage push answered) until samples are accepted,
  batches trained and weights published again (the latest of the three firsts, from the
  dataflow's own timestamps), with the parts ``recovery_push_s``, ``recovery_train_s``,
  ``recovery_publish_s``; ``fault_s``: how long the fault lasted;
* exit status 0 only if every scenario completed with nothing lost, nothing trained twice, no
  garbage push accepted and no cross-run sample;
* ``detail``: what the scenario observed (statuses of every garbage push, the 507 refusal, the
  publisher's skip after a resume, link counters) and ``audit``: task classes and ledgers; for
  ``state_disk_full``: ``state_refusals`` (writes refused with 507, from the dataflow's own
  count), ``episodes_started`` / ``episodes_ended`` (its log lines about the fault: one each per
  episode), ``tracebacks`` and ``answers_500`` (must be 0), ``clients_said`` (each client's
  "cannot store anything" lines); the scenario passes only with some refusals, no traceback
  and no 500.

The recipe is the toy one with these changes, all for a short run: no held-out eval (not
audited), ``--versions`` steps, leases of ``--lease-s`` (a dead RaaS's tasks come back within
the run), a batch ack timeout of 30 s, ``last.ckpt`` every ``--ckpt-every`` steps. The initial
policy is the recipe's warm start shortened to ``--sft-steps`` (300; accuracy is not what this
measures), built once under ``--work`` (or ``--model DIR``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere

from tests.fault_harness import SCENARIOS, Settings, log, prepare_model, run_scenario  # noqa: E402

LINE_KEYS = ("scenario", "completed", "tasks_issued", "samples_accepted", "samples_trained",
             "samples_lost", "duplicates_trained", "samples_rolled_back", "cross_run_samples",
             "recovery_s",
             "recovery_push_s",
             "recovery_train_s", "recovery_publish_s", "fault_s", "balanced", "final_version",
             "trainer_rc", "wall_s", "error", "detail", "audit")


def state_full_ok(r: dict) -> bool:
    """``state_disk_full`` saw writes refused with 507, logged them without a traceback or a
    500 (any other scenario: True)."""
    if r.get("scenario") != "state_disk_full":
        return True
    d = r.get("detail") or {}
    return bool(d.get("state_refusals")) and d.get("tracebacks") == 0 and d.get("answers_500") == 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="one JSON line per scenario (else a table)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help=f"comma-separated subset of {','.join(SCENARIOS)}")
    p.add_argument("--versions", type=int, default=16)
    p.add_argument("--fault-at", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=256, help="trainer batch (the recipe's)")
    p.add_argument("--lease-s", type=float, default=15.0)
    p.add_argument("--ckpt-every", type=int, default=3)
    p.add_argument("--partition-s", type=float, default=20.0)
    p.add_argument("--partition-mode", choices=("refuse", "drop"), default="drop")
    p.add_argument("--disk-full-refusals", type=int, default=3,
                   help="the disk stays full until this many weight uploads were refused")
    p.add_argument("--garbage-skip", default="",
                   help="garbage cases to leave out (comma-separated), e.g. token_out_of_vocab")
    p.add_argument("--timeout-s", type=float, default=420.0, help="per scenario")
    p.add_argument("--sft-steps", type=int, default=300,
                   help="warm-start steps of the initial policy (the recipe's 1500 take minutes "
                        "on a loaded 2-core host and change no fault figure; 0: the random tiny "
                        "model)")
    p.add_argument("--model", default=None, help="an initial policy folder to reuse")
    p.add_argument("--work", default=None, help="folder for run folders and logs (default: a "
                                                 "new temporary folder, kept)")
    args = p.parse_args(argv)
    names = [n for n in args.scenarios.split(",") if n]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        p.error(f"--scenarios: unknown {unknown}; choose from {list(SCENARIOS)}")
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_faults-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    settings = Settings(versions=args.versions, fault_at=args.fault_at,
                        batch_size=args.batch_size, lease_seconds=args.lease_s,
                        ckpt_every=args.ckpt_every, partition_s=args.partition_s,
                        partition_mode=args.partition_mode,
                        disk_full_refusals=args.disk_full_refusals,
                        max_concurrency=32, timeout_s=args.timeout_s,
                        garbage_skip=tuple(x for x in args.garbage_skip.split(",") if x))
    t0 = time.time()
    if args.model:
        model = Path(args.model)
    else:
        log(f"preparing the initial policy in {work / 'model'}")
        model = prepare_model(work / "model", args.sft_steps)
    log(f"work folder {work}; model {model}")
    results = []
    for name in names:
        log(f"--- {name}")
        r = run_scenario(name, work, model, settings)
        line = {k: r[k] for k in LINE_KEYS if k in r}
        results.append(line)
        if args.json:
            print(json.dumps(line), flush=True)
        log(f"{name}: completed={r['completed']} lost={r.get('samples_lost')} "
            f"dup={r.get('duplicates_trained')} recovery_s={r.get('recovery_s')} "
            f"wall={r['wall_s']}s")
    if not args.json:
        cols = ("scenario", "completed", "tasks_issued", "samples_accepted", "samples_trained",
                "samples_lost", "duplicates_trained", "recovery_s")
        print(" ".join(f"{c:>18}" for c in cols))
        for line in results:
            print(" ".join(f"{str(line.get(c)):>18}" for c in cols))
    log(f"all scenarios in {time.time() - t0:.0f}s")
    ok = all(r["completed"] and r.get("samples_lost") == 0 and r.get("duplicates_trained") == 0
             and not (r.get("detail") or {}).get("accepted_bad")
             and not r.get("cross_run_samples")
             and not ((r.get("detail") or {}).get("old_run") or {}).get("samples_lost")
             and state_full_ok(r)
             for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
