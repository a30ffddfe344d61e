"""Two real vLLM engines (solver, verifier) in one RaaS process, generating at the same time.

Two in-process vLLM engines must never run forward passes at once (vLLM's forward context is
process-global: two engines generating from two threads crashed the process). Both engines are
stepped by the process's one step driver, so requests of both policies are in flight together
(each engine batches its own continuously) and their forward passes alternate. Every task is
pushed once and every generated token carries the version that produced it."""

from __future__ import annotations

import io
import threading
import time

import pytest

from astralight.engine import SamplingSpec
from astralight.protocol import Task
from astralight.raas.config import RaaSConfig
from astralight.raas.service import RaaSService
from astralight.rewards.toy import ExactMatchReward
from astralight.workflows.latency import LongTailLatency
from astralight.workflows.solver_verifier import TOY_TEMPLATES, SolverVerifier
from tests.fakes import BatchingDataflow

pytestmark = pytest.mark.vllm


def test_two_vllm_engines_generate_at_once_in_one_raas(tiny_model_dir):
    from astralight.raas.vllm_engine import VLLMEngine

    engines = {m: VLLMEngine(str(tiny_model_dir), dtype="bfloat16", max_model_len=64, seed=i,
                             kv_cache_memory_bytes=1 << 27)
               for i, m in enumerate(("solver", "verifier"))}
    assert engines["solver"]._driver is engines["verifier"]._driver  # one stepping thread
    tasks = [Task(task_id=f"t{i}", prompt=f"{i}+{i}=", n=4, model_ids=["solver", "verifier"],
                  workflow="solver_verifier", metadata={"answer": str(2 * i)}) for i in range(24)]
    flow = BatchingDataflow(tasks)
    inner = SolverVerifier(ExactMatchReward(), sampling=SamplingSpec(temperature=1.0, max_tokens=4),
                           verifier_sampling=SamplingSpec(temperature=1.0, max_tokens=4),
                           **TOY_TEMPLATES)
    wf = LongTailLatency(inner, median_s=0.02, sigma=1.0, cap_s=0.2)
    cfg = RaaSConfig(dataflow="mem://", engines={m: {"model_path": "unused"} for m in engines},
                     workflow=wf, model_ids=["solver", "verifier"], max_concurrency=8,
                     poll_interval_s=0.01, progress_interval_s=1e9, weight_check_interval_s=3600.0)
    svc = RaaSService(cfg, client_factory=lambda: flow, engines=engines, out=io.StringIO())
    svc.start()
    both_busy = []  # probes that saw requests of both policies in flight at once

    def watch():
        deadline = time.monotonic() + 120
        while len(flow.pushed) < len(tasks) and time.monotonic() < deadline:
            if all(e.busy() for e in engines.values()):
                both_busy.append(time.monotonic())
            time.sleep(0.002)
        svc.request_stop()

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        assert svc.serve() == 0
    finally:
        watcher.join()
        svc.close()
    assert sorted(flow.pushed) == sorted(t.task_id for t in tasks)
    assert svc.counters.workflow_errors == 0
    assert both_busy, "the two policies never had requests in flight at the same time"
    for samples in flow.pushed.values():
        assert {s.model_id for s in samples} == {"solver", "verifier"}
        for s in samples:
            gen = s.versions[s.loss_mask.astype(bool)]
            assert gen.size and (gen == 0).all()
