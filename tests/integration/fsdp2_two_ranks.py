"""Two-rank ``ModelParallelStrategy`` (FSDP2) fit on CPU (gloo), run as a script by
tests/integration/test_fsdp2_fit.py (Lightning's launcher re-runs this file for rank 1).

    python tests/integration/fsdp2_two_ranks.py MODEL_DIR OUT_DIR [--lora]

Rank r trains on batches ``2*i + r`` of :func:`rank_batches` (step i), M2PO with micro-batches,
advantages normalised over the global batch, KL to the sharded reference, gradient checkpointing
and a gradient clip that binds; the strategy is ``FSDP2Strategy()`` with its defaults; the
production WeightPublisher (thread worker, a fake dataflow on rank 0) publishes every step. Only
rank 0 reads the model folder; rank 1 builds on the meta device and receives its shards. At the
end each rank writes what it holds (``rankR.json``: local vs full shape of every parameter, where
its weights came from), rank 0 the gathered publish state and what the fake dataflow received
(``rank0.pt``), and both ranks save the policy as a Hugging Face folder (``OUT_DIR/hf``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

STEPS = 2
SETTINGS = dict(lr=1e-3, micro_batch_size=2, kl_coef=0.1, grad_clip=0.05, normalize_advantages=True,
                gradient_checkpointing=True, loss="m2po", m2_threshold=0.01)
LORA = dict(r=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])


def rank_batches(model_dir: str, steps: int = STEPS) -> list:
    """``2 * steps`` deterministic protocol Batches (rank r of step i gets ``2*i + r``)."""
    from tests.fakes import FakeDataflowClient

    fake = FakeDataflowClient(model_dir, logprob_noise=0.3, seed=5)
    batches = [fake.make_batch(4) for _ in range(2 * steps)]
    # the ranks' shares differ in mean and spread (as different groups do), so normalising the
    # advantages per rank instead of over the global batch changes the update
    for i, batch in enumerate(batches):
        for j, sample in enumerate(batch.samples):
            sample.advantage = (3.0 * sample.advantage + 0.5 + 0.25 * j) if i % 2 else sample.advantage
    return batches


def main(model_dir: str, out_dir: str, lora: bool) -> None:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, IterableDataset

    from astralight.callbacks import WeightPublisher
    from astralight.datamodules import collate_batch
    from astralight.trainer.fsdp2_strategy import FSDP2Strategy
    from astralight.policy import M2POPolicy
    from astralight.weights import WeightState
    from tests.fakes import FakeDataflowClient

    out = Path(out_dir)
    collated = [collate_batch(b) for b in rank_batches(model_dir)]

    class PerRank(IterableDataset):
        def __iter__(self):
            rank = torch.distributed.get_rank()
            for i in range(STEPS):
                yield collated[2 * i + rank]

    class Record(pl.Callback):
        def on_train_end(self, trainer, pl_module):
            from torch.distributed.tensor import DTensor

            shards = {n: {"local": list(p.to_local().shape), "full": list(p.shape),
                          "dtensor": isinstance(p, DTensor), "trainable": p.requires_grad}
                      for n, p in pl_module.model.named_parameters()}
            (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(
                {"world_size": trainer.world_size, "shards": shards,
                 "mesh_size": pl_module._device_mesh.size(),
                 "weights_source": pl_module.weights_source,
                 "ref_sharded": pl_module.ref_model is None or all(
                     isinstance(p, DTensor) for p in pl_module.ref_model.parameters())}))
            state = publisher.publish_state(trainer, pl_module)  # collective: every rank joins
            pl_module.save_pretrained(str(out / "hf"))  # collective too
            if trainer.is_global_zero:
                publisher.flush(120)
                ws = WeightState()
                for m in fake.manifests:
                    ws.apply(m, {n: d for v, n, d in fake.uploads if v == m.version})
                torch.save({"state": {k: v.clone() for k, v in state.items()},
                            "manifests": [(m.version, m.kind, sorted(m.tensors))
                                          for m in fake.manifests],
                            "received": {n: torch.from_numpy(a.copy()) for n, a in ws.state.items()},
                            "grad_norms": norms},
                           out / "rank0.pt")

    norms: list[float] = []

    class Norms(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            norms.append(float(trainer.callback_metrics["train/grad_norm"]))

    fake = FakeDataflowClient(model_dir)
    publisher = WeightPublisher(worker="thread", full_every=10)
    publisher.client = fake
    policy = M2POPolicy(model_dir, lora=LORA if lora else None, **SETTINGS)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2,
        strategy=FSDP2Strategy(),  # defaults: data parallel over every process ("auto")
        precision="32-true", max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        callbacks=[publisher, Norms(), Record()])
    trainer.fit(policy, train_dataloaders=DataLoader(PerRank(), batch_size=None))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1], sys.argv[2], "--lora" in sys.argv[3:])
