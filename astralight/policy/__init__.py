"""The policy LightningModules: ``RLPolicy`` (the base) and ``M2POPolicy`` (the default objective).

One trainer process per policy (``model_id``). Each training step takes one trainer batch (see
``astralight.datamodules.rollout.collate_batch``: right-padded ``input_ids``, ``loss_mask``, ``behaviour_logprobs``,
``versions``, per-sample ``advantages``), computes the policy's token log-probs at the sampling
temperature, the objective, and takes **one optimizer step** (or ``minibatches x batch_passes``
updates: PPO mini-batches and epochs over the same batch, still one Lightning step, one version);
then it acknowledges the batch to the dataflow, so a crash before the step re-serves it.

:class:`RLPolicy` does everything that is not the objective: loading the Hugging Face model,
checking and shifting the batch, log-probs (chunked, at the temperature), micro-batching and
gradient accumulation, the optional k3 KL penalty to the frozen initial model, AdamW with
warm-up, gradient clipping, the acknowledgement with the step timing the balance report uses,
and the ``train/*`` / ``perf/*`` metrics. :class:`M2POPolicy` is an ``RLPolicy`` that implements
:meth:`RLPolicy.compute_loss` with M2PO (or its released variant, or PPO-clip).

Gradient accumulation and whole-batch statistics
------------------------------------------------
A statistic such as M2PO's must see every token of the optimizer batch (all ranks, all
micro-batches), but a backward pass must not wait for it. With ``micro_batch_size`` set, the
module uses **manual optimization**: (1) a no-grad forward over the whole batch in micro-batches
gives the log-probs, from which :meth:`RLPolicy.loss_context` fixes the whole-batch context
(the loss normalisers, the M2 keep mask all-gathered across ranks and, if ``kl_coef > 0``, the
reference log-probs); (2) each micro-batch is run again with grad and back-propagated with that
fixed context (DDP gradient sync only on the last one); (3) one clip + optimizer step. This
costs one extra forward (~1/3 more compute) only when micro-batching; with
``micro_batch_size=None`` (or >= the batch) the single grad forward's detached log-probs feed the
context directly. Dropout is disabled at load (``disable_dropout``) so that the two passes, and
the ratio on fresh data, agree.

Distributed training
--------------------
DDP (``strategy: ddp``) for a model that fits on one GPU; for sharded training, FSDP2 through
:class:`astralight.trainer.fsdp2_strategy.FSDP2Strategy` (Lightning's ``ModelParallelStrategy``;
``data_parallel_size: auto`` = every GPU of the trainer, ``tensor_parallel_size: 1``):
:meth:`RLPolicy.configure_model` shards the model (after the peft wrap) and the KL reference with
``fully_shard`` per decoder layer, the trainer's ``precision`` maps onto FSDP2's mixed precision
(``bf16-mixed``: fp32 masters, bf16 all-gather/compute, fp32 reduce; see :mod:`astralight.trainer.fsdp2`),
and the gradient clip takes the global norm over the DTensor shards. Lightning's ``FSDPStrategy``
(FSDP1) is refused at setup: Lightning runs ``training_step`` inside FSDP1's root forward, where
several forward/backward passes per step break FSDP1 (Lightning issue #19685).

Extension points: a new objective is one method
-----------------------------------------------
Subclass :class:`RLPolicy` and implement :meth:`RLPolicy.compute_loss`
(``(batch, logp) -> (loss, metrics)``); optionally extend :meth:`RLPolicy.loss_context` when the
objective needs a whole-batch statistic or per-batch state (a group baseline, a running mean),
and :meth:`RLPolicy.prepare_batch` (with ``super().prepare_batch(batch)``) to add fields of
its own. ``batch`` there is a (micro-)batch of *shifted* tensors, all ``[b, T-1]`` and aligned
with ``logp``: ``mask`` (bool, trained tokens), ``logp_behaviour``, ``advantages`` (per token,
0 off mask), ``versions``; per sample ``sample_advantages`` / ``rewards`` / ``group_ids``
``[b]`` (samples of one task share an id) and the lists ``task_ids`` / ``metadata`` (sliced
with the micro-batch like the tensors); the batch's ``batch_id``, ``model_id``,
``policy_version`` and ``trainer_version``; ``n_tokens`` / ``n_samples`` (the normalisers: loss
tokens / samples of the whole optimizer batch over all ranks / world size) and whatever
:meth:`RLPolicy.loss_context` added. Return a loss normalised by ``batch["n_tokens"]`` (or
``batch["n_samples"]``) so micro-batch losses add up to the batch loss; metric values are
scalars (combined over micro-batches by a token-weighted mean, ``*_loss`` summed,
``*_max``/``*_min`` by max/min) and are logged as ``train/<name>``. The KL penalty and the
unlikelihood of negative samples (``unlikelihood_coef``, :mod:`astralight.rl.unlikelihood`) are
added by the base class, so every objective gets them; so are ``train/entropy`` (the policy's entropy per
trained token, from the logits already computed) and the reward, advantage, staleness and
throughput metrics. The optimizer and its schedule are the ``optimizer`` / ``lr_scheduler``
arguments (``astralight fit --optimizer ... --lr_scheduler ...``), not a method to override.
``examples/custom_trainer/`` is a worked example (REINFORCE with a running-mean baseline) run by
``astralight fit`` through YAML ``class_path``.

A group baseline (leave-one-out, RLOO) groups by ``group_ids`` in :meth:`RLPolicy.loss_context`
(the whole optimizer batch, before any micro-batch). The dataflow serves samples, not groups, so
a task's group can be split between two batches (stale drops, sample filters, a batch size that
is not a multiple of the group size): count each group's members in the batch, and fall back
(e.g. to the dataflow's ``advantages``, computed over the whole group at ingest) for a sample
left alone.

Modules
-------
:mod:`~astralight.policy.base` (:class:`RLPolicy`: the Lightning hooks and the step),
:mod:`~astralight.policy.m2po` (:class:`M2POPolicy`), :mod:`~astralight.policy.batch` (checking,
shifting and slicing a trainer batch), :mod:`~astralight.policy.causal_lm` (loading, sharding
and saving the Hugging Face model), :mod:`~astralight.policy.optimizer` (the optimizer and
schedule specs) and :mod:`~astralight.policy.metrics` (the ``train/*`` / ``perf/*`` metrics).
Import from ``astralight.policy``: ``class_path: astralight.policy.M2POPolicy`` in a trainer
config, ``from astralight.policy import RLPolicy`` in a custom trainer.
"""

from astralight.policy.base import RLPolicy
from astralight.policy.batch import BATCH_KEYS as _BATCH_KEYS  # noqa: F401 (the batch contract)
from astralight.policy.causal_lm import empty_causal_lm, load_causal_lm
from astralight.policy.m2po import LOSSES, M2POPolicy
from astralight.policy.optimizer import check_class_spec

__all__ = ["RLPolicy", "M2POPolicy", "LOSSES", "load_causal_lm", "empty_causal_lm",
           "check_class_spec"]
