"""A restarted autoscaler adopts the instances an earlier run of it left registered.

Before: ``start()`` launched the whole initial pool whatever the dataflow's table held, so a
restart under a command backend (Slurm / kubectl jobs outlive the autoscaler) doubled the pool,
and the earlier instances, unmanaged, were never retired nor drained on shutdown.
"""

from __future__ import annotations

import io
import json

from astralight.autoscale.policy import Policy, PolicyConfig
from astralight.autoscale.service import AutoscaleConfig, Autoscaler
from tests.fakes import FakeAutoscaleDataflow as FakeDataflow
from tests.unit.autoscale_fakes import Clock, FakeBackend


class ClusterBackend(FakeBackend):
    """Like a command backend without an ``alive`` template: cannot tell liveness, can name
    (and so retire) any instance."""

    def alive(self, instance_id):
        return True if instance_id in self.running else None

    def manages(self, instance_id):
        return True


class LocalBackend(FakeBackend):
    """Like the local backend: only its own children; an adopted instance is not one."""

    def alive(self, instance_id):
        return (instance_id in self.running) if instance_id in self._started else None

    def launch(self, instance_id, n=None):
        self._started.add(instance_id)
        super().launch(instance_id, n)

    def manages(self, instance_id):
        return instance_id in self._started

    def __init__(self):
        super().__init__()
        self._started: set[str] = set()


def row(iid, status="healthy", state="active", model="policy", at=900.0):
    return {"instance_id": iid, "model_ids": [model], "status": status, "state": state,
            "samples_per_s": 1.0, "registered_at": at}


def scaler_for(tmp_path, backend, flow, initial=2, **policy_kw):
    clock = Clock()
    cfg = PolicyConfig(**{"min_instances": 1, "max_instances": 4, "cooldown_s": 30, **policy_kw})
    return Autoscaler(Policy(cfg), backend, flow,
                      AutoscaleConfig(every=5, initial=initial,
                                      decisions_log=str(tmp_path / "d.jsonl")),
                      clock=clock, wall=lambda: 1000.0 + clock.t, out=io.StringIO(),
                      sleep=clock.sleep)


def test_restart_adopts_the_registered_pool_instead_of_doubling_it(tmp_path):
    backend, flow = ClusterBackend(), FakeDataflow()
    flow.rows = {i: row(i) for i in ("auto-0", "auto-1")}
    # not adopted: another prefix, another policy, on their way out, silent
    flow.rows.update({"other-0": row("other-0"), "auto-7": row("auto-7", model="verifier"),
                      "auto-3": row("auto-3", state="draining", status="draining"),
                      "auto-4": row("auto-4", state="left", status="left"),
                      "auto-5": row("auto-5", status="gone")})
    scaler = scaler_for(tmp_path, backend, flow, initial=2)
    scaler.start()
    assert [c for c in backend.calls if c[0] == "launch"] == []
    assert scaler.adopted == ["auto-0", "auto-1"] and sorted(scaler.managed) == ["auto-0", "auto-1"]
    logged = [json.loads(x) for x in (tmp_path / "d.jsonl").read_text().splitlines()]
    assert [e["action"] for e in logged] == ["adopt"] and logged[0]["adopted"] == ["auto-0", "auto-1"]
    scaler.step()  # nothing died, nothing to adopt twice, pool within bounds
    assert [e["action"] for e in scaler.decisions] == ["adopt"]
    # on shutdown the adopted instances are retired like its own (drain + retire command)
    scaler.shutdown()
    assert sorted(c[1] for c in backend.calls if c[0] == "retire") == ["auto-0", "auto-1"]


def test_restart_launches_only_the_shortfall_with_fresh_names(tmp_path):
    backend, flow = ClusterBackend(), FakeDataflow()
    flow.rows = {"auto-4": row("auto-4")}
    scaler = scaler_for(tmp_path, backend, flow, initial=3)
    scaler.start()
    assert [c for c in backend.calls if c[0] == "launch"] == [("launch", "auto-5", 3),
                                                              ("launch", "auto-6", 3)]
    assert [e["action"] for e in scaler.decisions] == ["adopt", "initial"]
    assert scaler.decisions[1]["pool"] == 1 and "1 adopted" in scaler.decisions[1]["reason"]


def test_an_instance_that_registers_late_is_adopted_and_the_pool_trimmed_to_max(tmp_path):
    backend, flow = ClusterBackend(), FakeDataflow()
    scaler = scaler_for(tmp_path, backend, flow, initial=2, max_instances=2)
    scaler.start()
    assert sorted(backend.running) == ["auto-0", "auto-1"]
    # a job an earlier run queued before it was killed registers now
    flow.rows = {"auto-0": row("auto-0"), "auto-1": row("auto-1"), "auto-9": row("auto-9", at=1001)}
    scaler.step()
    actions = [e["action"] for e in scaler.decisions]
    assert actions == ["initial", "adopt", "scale_down"]
    assert len(scaler.decisions[2]["retire"]) == 1
    assert len(scaler.managed) == 2


def test_an_adopted_local_instance_is_drained_through_the_route(tmp_path):
    backend, flow = LocalBackend(), FakeDataflow()
    flow.rows = {"auto-0": row("auto-0")}
    scaler = scaler_for(tmp_path, backend, flow, initial=1)
    scaler.start()
    scaler.step()
    assert scaler.adopted == ["auto-0"] and "auto-0" in scaler.managed  # not reaped as died
    scaler.shutdown()
    assert flow.drained == ["auto-0"] and [c for c in backend.calls if c[0] == "retire"] == []


def test_the_table_unreadable_at_start_still_launches_then_adopts(tmp_path):
    backend, flow = ClusterBackend(), FakeDataflow()
    stats = flow.stats
    flow.stats = lambda: (_ for _ in ()).throw(ConnectionError("refused"))
    scaler = scaler_for(tmp_path, backend, flow, initial=1)
    scaler.start()
    assert backend.calls == [("launch", "auto-0", 1)]
    assert "could not read the instance table" in scaler.out.getvalue()
    flow.stats = stats
    flow.rows = {"auto-0": row("auto-0"), "auto-3": row("auto-3")}
    scaler.step()
    assert scaler.adopted == ["auto-3"] and scaler._k == 4
