"""WeightPublisher.snapshot under FSDP2 (``fully_shard``, DTensor parameters) on CPU with gloo:
every rank joins the full-state gather, rank 0 gets the whole model under its HF names, bit for
bit the unsharded weights in bf16; the other rank gets None.

Lightning's FSDP strategies need GPUs, so the trainer is a stand-in holding what ``snapshot``
reads (``strategy.model``, ``is_global_zero``); the module, sharding and collective are real.
"""

from __future__ import annotations

import os
import types

import torch

from tests.conftest import free_port


def _worker(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from astralight.callbacks import WeightPublisher
    from astralight.policy import M2POPolicy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        policy = M2POPolicy(model_dir)
        policy.configure_model()
        expected = {k: v.to(torch.bfloat16) for k, v in policy.model.state_dict().items()}
        mesh = init_device_mesh("cpu", (world,))
        for layer in policy.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(policy, mesh=mesh)
        from torch.distributed.tensor import DTensor

        assert all(isinstance(p, DTensor) for p in policy.parameters())
        trainer = types.SimpleNamespace(strategy=types.SimpleNamespace(model=policy),
                                        is_global_zero=rank == 0)
        snap = WeightPublisher().snapshot(trainer, policy)
        if rank == 0:
            torch.save({"snap": snap, "expected": expected}, os.path.join(out_dir, "rank0.pt"))
        else:
            torch.save({"snap": snap}, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_fsdp2_snapshot_gathers_full_state_on_rank0(tiny_model_dir, tmp_path):
    import torch.multiprocessing as mp

    try:
        mp.spawn(_worker, args=(2, free_port(), str(tiny_model_dir), str(tmp_path)), nprocs=2)
    except mp.ProcessExitedException as exc:  # gloo may abort in teardown after the work is done
        if not (tmp_path / "rank0.pt").exists() or not (tmp_path / "rank1.pt").exists():
            raise
        print(f"ignored teardown exit: {exc}")
    r0 = torch.load(tmp_path / "rank0.pt")
    r1 = torch.load(tmp_path / "rank1.pt")
    assert r1["snap"] is None
    snap, expected = r0["snap"], r0["expected"]
    assert set(snap) == set(expected) and len(snap) == 25  # HF names, no FSDP prefixes
    for name, t in expected.items():
        assert snap[name].dtype == torch.bfloat16 and not hasattr(snap[name], "device_mesh")
        assert torch.equal(snap[name], t), name
