"""Group commit under kill -9: a real dataflow process on 127.0.0.1 (real SQLite, group commit
on, the default) is SIGKILLed while four RaaS-like clients push concurrently -- two with
``push_many`` (batches of tasks), two with ``push`` (one task per request) -- and restarted on
the same state folder. Every push that got a success reply must be there, byte for byte, and
still be a duplicate when pushed again; every other task, pushed again, is accepted or a
duplicate, so that in the end each task's samples were accepted exactly once.
"""

from __future__ import annotations

import signal
import threading
from collections import Counter

import numpy as np

from astralight.dataflow.client import DataflowClient, DataflowError
from astralight.protocol import Sample

GROUP = 2
CLIENTS = {"batched-0": True, "batched-1": True, "single-0": False, "single-1": False}
TASKS_PER_CLIENT = 120
BATCH = 6
#: the kill comes once this many tasks of each kind (batched, single) were acknowledged
ACKED_BEFORE_KILL = 12


def make_group(rng: np.random.Generator, task_id: str) -> list[Sample]:
    """A group whose tokens and rewards differ per task (so a mix-up would show)."""
    out = []
    for i in range(GROUP):
        gen = int(rng.integers(3, 20))
        out.append(Sample(task_id=task_id, sample_index=i, model_id="policy",
                          token_ids=rng.integers(0, 1000, 3 + gen).astype(np.int32),
                          logprobs=np.concatenate([np.zeros(3),
                                                   -rng.random(gen)]).astype(np.float32),
                          loss_mask=np.array([0] * 3 + [1] * gen, np.uint8),
                          versions=np.array([-1] * 3 + [0] * gen, np.int32),
                          reward=float(rng.random()), prompt_len=3))
    return out


class Ledger:
    """What the pushers were told: tasks acknowledged (a success reply), tasks whose push failed."""

    def __init__(self):
        self.cond = threading.Condition()
        self.acked: dict[str, dict] = {}  # task_id -> reply
        self.acked_by_kind: Counter = Counter()
        self.failed: dict[str, Exception] = {}

    def record(self, kind: str, task_id: str, reply) -> bool:
        """Note one item's outcome; False once the service stopped answering."""
        with self.cond:
            if isinstance(reply, dict):
                self.acked[task_id] = reply
                self.acked_by_kind[kind] += 1
            else:
                self.failed[task_id] = reply
            self.cond.notify_all()
        return isinstance(reply, dict)

    def enough(self) -> bool:
        return all(self.acked_by_kind[k] >= ACKED_BEFORE_KILL for k in ("batched", "single"))


def pusher(url: str, iid: str, work: list, batched: bool, ledger: Ledger) -> None:
    """Push ``work`` (``[(task_id, samples)]``) until done or the service is gone."""
    client = DataflowClient(url, retry_s=0.5, timeout=30)
    kind = "batched" if batched else "single"
    try:
        step = BATCH if batched else 1
        for i in range(0, len(work), step):
            chunk = work[i:i + step]
            if batched:
                replies = client.push_many(iid, chunk)
            else:
                try:
                    replies = [client.push(iid, *chunk[0])]
                except DataflowError as exc:
                    replies = [exc]
            ok = [ledger.record(kind, tid, r) for (tid, _), r in zip(chunk, replies)]
            if not all(ok):
                return
    finally:
        client.close()


def test_kill9_during_concurrent_pushes_loses_nothing_acknowledged(tmp_path, dataflow_service,
                                                                    client_for):
    total = len(CLIENTS) * TASKS_PER_CLIENT
    cfg = dict(group_size=GROUP, lease_seconds=3600, max_inflight_tasks=total,
               max_buffered_samples=total * GROUP, log_level="WARNING")
    url, proc, _ = dataflow_service(tmp_path, **cfg)
    admin = client_for(url)
    rng = np.random.default_rng(0)
    plans, sent = {}, {}
    for name in CLIENTS:
        iid = admin.register(["policy"], capacity=TASKS_PER_CLIENT, instance_id=name)["instance_id"]
        tasks = admin.lease(iid, TASKS_PER_CLIENT)
        assert len(tasks) == TASKS_PER_CLIENT
        plans[name] = (iid, [(t.task_id, make_group(rng, t.task_id)) for t in tasks])
        sent.update(plans[name][1])
    assert admin.stats()["durability"]["group_commit"] is True

    ledger = Ledger()
    threads = [threading.Thread(target=pusher, args=(url, iid, work, CLIENTS[name], ledger))
               for name, (iid, work) in plans.items()]
    for t in threads:
        t.start()
    with ledger.cond:
        assert ledger.cond.wait_for(ledger.enough, timeout=300), dict(ledger.acked_by_kind)
    proc.send_signal(signal.SIGKILL)  # while the four are pushing
    proc.wait()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a pusher never noticed the service was gone"
    acked = dict(ledger.acked)
    assert ledger.failed, "the kill came after every push: nothing was in flight"
    assert len(acked) < total
    assert all(r == {"accepted": GROUP, "filtered": 0, "duplicate": False} for r in acked.values())

    url2, proc2, _ = dataflow_service(tmp_path, **cfg)  # same state_dir
    c2 = client_for(url2)
    queued = c2.stats()["models"]["policy"]["queue_depth"]
    assert queued >= len(acked) * GROUP  # acknowledged ones, maybe some whose answer was lost
    batch = c2.pull_batch("policy", queued, timeout_s=0)
    got = {(s.task_id, s.sample_index): s for s in batch.samples}
    for task_id in acked:  # every acknowledged push is there, byte for byte
        for orig in sent[task_id]:
            s = got[(task_id, orig.sample_index)]
            assert s.token_ids.tobytes() == orig.token_ids.tobytes()
            assert s.logprobs.tobytes() == orig.logprobs.tobytes()
            assert s.reward == orig.reward
    c2.ack(batch.batch_id)
    # acknowledged tasks stay done; the rest is accepted now or was committed unanswered
    by_instance = {tid: plans[name][0] for name in plans for tid, _ in plans[name][1]}
    again = c2.push_many("batched-0", [(tid, sent[tid]) for tid in list(acked)[:BATCH]])
    assert all(r["duplicate"] is True for r in again)
    for tid in acked:
        assert c2.push(by_instance[tid], tid, sent[tid])["duplicate"] is True
    rest = [tid for tid in sent if tid not in acked]
    replies = []
    for i in range(0, len(rest), BATCH):
        chunk = rest[i:i + BATCH]
        replies += c2.push_many(by_instance[chunk[0]], [(tid, sent[tid]) for tid in chunk])
    assert all(isinstance(r, dict) for r in replies), [r for r in replies
                                                       if not isinstance(r, dict)]
    committed_unanswered = sum(r["duplicate"] for r in replies)
    assert committed_unanswered == queued // GROUP - len(acked)
    m = c2.stats()["models"]["policy"]
    assert m["samples_accepted"] == total * GROUP  # each task exactly once, nothing lost
    print(f"kill -9 after {len(acked)} acknowledged pushes of {total} "
          f"({dict(ledger.acked_by_kind)}), {len(ledger.failed)} failed in flight, "
          f"{committed_unanswered} committed but unanswered")
    proc2.send_signal(signal.SIGTERM)
    assert proc2.wait(timeout=20) == 0
