"""``RLPolicy``: the base LightningModule of every policy trainer, everything but the objective.

The design (gradient accumulation with whole-batch statistics, distribution, the extension
points and every batch key) is the :mod:`astralight.policy` docstring. This module holds the
Lightning hooks and the step; the parts that need no module state live beside it: the model
(:mod:`astralight.policy.causal_lm`), the optimizer (:mod:`astralight.policy.optimizer`), the
batch (:mod:`astralight.policy.batch`) and the metrics (:mod:`astralight.policy.metrics`).
"""

from __future__ import annotations

import contextlib
import inspect
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.core.optimizer import do_nothing_closure
import torch
from torch import Tensor

from astralight.trainer.hf_models import check_model_path
from astralight.trainer.lora import LoraSpec
from astralight.policy import batch as batch_ops
from astralight.policy.arg_checks import check_init_args
from astralight.policy.causal_lm import build_policy_models, save_model_folder
from astralight.policy.metrics import (batch_stats, combine_metrics, mean_over_updates,
                                       perf_metrics)
from astralight.policy.metrics import staleness_reference as _staleness_reference
from astralight.policy.optimizer import build_optimizers, check_class_spec
from astralight.rl.entropy import masked_entropy_sum
from astralight.rl.kl import kl_penalty
from astralight.rl.logprobs import (causal_lm_logprobs, causal_lm_next_logits,
                                    first_trained_target, pad_to_targets, token_logprobs)
from astralight.rl.m2po import all_reduce_sum
from astralight.rl.mismatch import mismatch_metrics
from astralight.rl.unlikelihood import unlikelihood_penalty


def _init_arg_order(cls: type) -> dict[str, int]:
    """Position of every named ``__init__`` argument, most-derived class first."""
    order: dict[str, int] = {}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        for name, param in inspect.signature(init).parameters.items():
            if name != "self" and param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                order.setdefault(name, len(order))
        if klass is RLPolicy:
            break
    return order


class RLPolicy(pl.LightningModule):
    """Base LightningModule of a policy trainer: everything but the objective.

    Subclass it and implement :meth:`compute_loss` (the one required method) to train a policy
    with a new objective; the model, the batch plumbing, micro-batching, the KL penalty, the
    optimizer, the acknowledgement of batches and the metrics are shared with
    :class:`astralight.policy.M2POPolicy`. Name the subclass in the trainer config
    (``model: {class_path: my_module.MyPolicy, init_args: {...}}``) and run ``astralight fit``
    (whose model must be an ``RLPolicy``: ``astralight fit --model.help`` lists them).

    Extension points, in the order a step calls them: :meth:`prepare_batch` (the collated batch
    -> shifted tensors plus the group structure: ``group_ids``, ``task_ids``, ``metadata``,
    ``policy_version``, ...; extend with ``super().prepare_batch(batch)``), :meth:`loss_context`
    (once per optimizer batch, before any backward: whole-batch statistics and per-batch state,
    e.g. a group baseline), :meth:`compute_loss` (per micro-batch: the objective). The module
    docstring lists every batch key.

    Args:
        model_path: Hugging Face model folder (the same folder the RaaS starts from: version 0).
        model_id: the policy this trainer owns; batches of another ``model_id`` are refused.
        kl_coef: k3 KL penalty to the initial model, added to every objective's loss; 0 loads
            no reference model.
        kl_decay_steps: when > 0, the KL coefficient falls linearly from ``kl_coef`` at the
            first batch to 0 after this many batches (``global_step``: one per batch, however
            many ``minibatches`` it is cut into, and restored on resume); from then on no
            reference log-probs are computed (the reference model stays loaded). It holds the
            policy near the warm start while it first sharpens, so no answer saturates on a
            wrong guess, and lets go before the penalty would pull back what was learnt.
            0 (default): constant.
        entropy_coef: weight of an entropy bonus: ``entropy_coef x`` the policy's mean entropy
            per trained token (at the temperature, over the batch's ``n_tokens``) is subtracted
            from every objective's loss, against the collapse onto what the policy already
            samples; 0 (default) adds nothing and computes the entropy as a metric only.
        temperature: sampling temperature of the behaviour policy; batches whose samples say
            otherwise are refused (their behaviour log-probs would not be comparable).
        unlikelihood_coef: weight of the sequence unlikelihood on negative samples,
            ``-max(0, -A) * log(1 - pi(y|x))`` per sample over the batch's ``n_samples``
            (:mod:`astralight.rl.unlikelihood`): it pushes down a failing completion the harder
            the surer the policy is of it, where the policy gradient's push vanishes. With the
            dataflow's ``failed_group_advantage`` below 0 it reaches the groups in which every
            sample failed, the ones a collapsed policy leaves without gradient. 0 (default)
            adds nothing.
        lr, weight_decay, betas: AdamW; ``warmup_steps`` of linear warm-up, then constant.
        micro_batch_size: samples per forward/backward; ``None`` = the whole batch at once.
        minibatches: optimizer updates per pass over a batch: the batch is cut into this many
            contiguous parts of (nearly) equal size, each its own clip + optimizer step with its
            own :meth:`loss_context` (verl's PPO mini-batches, TRL's ``steps_per_generation``).
            Contiguous parts keep a task's samples together (the datamodule serves them so).
        batch_passes: passes over each batch (PPO epochs, TRL's ``num_iterations``): a pass
            after the first re-reads the same samples with the weights the earlier updates
            made, so the ratio to the behaviour log-probs moves off 1 and the objective's trust
            region (M2PO's second-moment mask, PPO's clip) bounds the reuse. When rollouts are
            the bottleneck (the trainer waits for batches), more updates per batch turn that
            wait into learning; ``minibatches * batch_passes`` optimizer updates per batch in
            all. The batch is still one Lightning step: ``global_step``, ``max_steps``, the
            published version and checkpoint intervals count batches, as with one update.
        grad_clip: max global gradient norm (``None`` or 0: no clipping, norm still logged).
        skip_empty_updates: an update whose gradient is exactly zero everywhere (every token's
            advantage 0 and no KL, entropy or unlikelihood term: a minibatch of all-correct or
            all-failed groups) leaves the optimizer untouched instead of stepping it. AdamW
            steps on a zero gradient still move every weight by its momentum, scaled by a
            second moment that decays while nothing is learnt, so after convergence a lone
            failure followed by quiet updates drifts the policy several times further than its
            own update would (seen: a run at 1.00 accuracy fell to 0.43, its ratios moving to
            0.23 over five all-zero updates). ``global_step``, the version and the learning
            rate schedule still advance. ``False``: step anyway, as TRL and PyTorch do. Not
            under fp16 mixed precision (``16-mixed``), whose gradient scaler cannot step an
            optimizer without gradients: there every update steps.
        normalize_advantages: renormalise the batch's advantages to zero mean, unit std.
        seed: torch seed set at fit start.
        gradient_checkpointing: trade compute for activation memory in the HF model.
        disable_dropout: zero every dropout of the loaded model (recommended for RL).
        logprob_chunk_tokens: token positions per log-softmax chunk (memory bound; ``None``: auto).
        lora: train a LoRA adapter (peft) instead of all weights, e.g.
            ``{r: 16, alpha: 32, dropout: 0.0, target_modules: [q_proj, v_proj], publish: adapter}``
            (keys and defaults: :class:`astralight.trainer.lora.LoraSpec`). Only the adapter parameters
            train. ``publish: adapter`` makes the WeightPublisher send only the adapter tensors
            (PEFT names; the RaaS engine needs ``enable_lora``), ``publish: merged`` the merged
            full weights under the base names. With ``kl_coef > 0`` the KL reference is the base
            model itself with the adapters disabled (no second model is loaded).
        optimizer: ``{class_path, init_args}`` of a ``torch.optim.Optimizer`` that replaces
            AdamW (``lr``, ``betas`` and ``weight_decay`` then do not apply: give them in its
            ``init_args``). ``astralight fit --optimizer SGD --optimizer.lr 0.01`` (or a
            top-level ``optimizer:`` in the trainer YAML) sets it.
        lr_scheduler: ``{class_path, init_args}`` of a ``torch.optim.lr_scheduler.LRScheduler``
            that replaces the warm-up, stepped once per optimizer update (``astralight fit
            --lr_scheduler``); ``ReduceLROnPlateau`` is refused (it needs a monitored metric).

    Gradient clipping is ``grad_clip`` (the policy optimises manually, so Lightning's own
    clipping cannot run); ``astralight fit --trainer.gradient_clip_val X`` sets ``grad_clip``.

    A subclass with its own arguments takes them first and passes the rest on, e.g.
    ``def __init__(self, model_path: str, my_arg: float = 1.0, **kwargs)`` then
    ``super().__init__(model_path, **kwargs)``: ``astralight fit`` (jsonargparse) follows the
    ``**kwargs`` to these arguments, and every argument lands in ``hparams`` and checkpoints.
    """

    def __init__(
        self,
        model_path: str,
        model_id: str = "policy",
        kl_coef: float = 0.0,
        kl_decay_steps: int = 0,
        entropy_coef: float = 0.0,
        temperature: float = 1.0,
        unlikelihood_coef: float = 0.0,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        warmup_steps: int = 0,
        micro_batch_size: int | None = None,
        minibatches: int = 1,
        batch_passes: int = 1,
        grad_clip: float | None = 1.0,
        skip_empty_updates: bool = True,
        normalize_advantages: bool = False,
        seed: int = 0,
        gradient_checkpointing: bool = False,
        disable_dropout: bool = True,
        logprob_chunk_tokens: int | None = None,
        lora: dict | None = None,
        optimizer: dict | None = None,
        lr_scheduler: dict | None = None,
    ):
        super().__init__()
        cls = type(self)
        check_init_args(cls, temperature=temperature, micro_batch_size=micro_batch_size,
                        minibatches=minibatches, batch_passes=batch_passes, kl_coef=kl_coef,
                        kl_decay_steps=kl_decay_steps, entropy_coef=entropy_coef,
                        unlikelihood_coef=unlikelihood_coef)
        optimizer = check_class_spec(optimizer, "optimizer", torch.optim.Optimizer)
        lr_scheduler = check_class_spec(lr_scheduler, "lr_scheduler",
                                        torch.optim.lr_scheduler.LRScheduler)
        lora_spec = LoraSpec.from_config(lora)
        if lora_spec is not None and lora_spec.dropout > 0 and disable_dropout:
            raise ValueError(
                f"lora.dropout: {lora_spec.dropout} while disable_dropout is true; the two forward "
                "passes of micro-batching and the ratio on fresh data need a deterministic "
                "forward: set lora.dropout: 0, or disable_dropout: false to accept the noise")
        # Collects the init arguments of this class and of every subclass __init__ in the call
        # chain (those that call super().__init__), so a subclass's own arguments are saved too;
        # then saves them again in the most-derived signature's order (hparams.yaml then reads
        # as the subclass's signature).
        self.save_hyperparameters()
        order = _init_arg_order(cls)
        names = sorted(self.hparams, key=lambda k: order.get(k, len(order)))
        self.hparams.clear()  # save_hyperparameters updates the dict in place: refill it in order
        self.save_hyperparameters(*names)
        check_model_path(model_path, "model.init_args.model_path")
        self.model_path = model_path
        self.model_id = model_id
        self.kl_coef = kl_coef
        self.kl_decay_steps = kl_decay_steps
        self.entropy_coef = entropy_coef
        self.temperature = temperature
        self.unlikelihood_coef = unlikelihood_coef
        self.lr = lr
        self.weight_decay = weight_decay
        self.betas = tuple(betas)
        self.warmup_steps = warmup_steps
        self.micro_batch_size = micro_batch_size
        self.minibatches = minibatches
        self.batch_passes = batch_passes
        self.grad_clip = grad_clip
        self.skip_empty_updates = skip_empty_updates
        self.normalize_advantages = normalize_advantages
        self.seed = seed
        self.gradient_checkpointing = gradient_checkpointing
        self.disable_dropout = disable_dropout
        self.logprob_chunk_tokens = logprob_chunk_tokens
        self.lora_spec = lora_spec
        self.optimizer_spec = optimizer
        self.lr_scheduler_spec = lr_scheduler
        self.automatic_optimization = False
        self.model: torch.nn.Module | None = None
        # The reference model is kept out of the module tree: not trained, not checkpointed.
        self._ref: list[torch.nn.Module] = []
        self._sharded = False  # FSDP2: model (and reference) sharded in configure_model
        #: where this rank's weights came from in configure_model: "file" (read from model_path)
        #: or "rank0" (FSDP2 rank > 0: built on the meta device, shards broadcast from rank zero)
        self.weights_source: str | None = None
        self._last_step_end: float | None = None

    # ------------------------------------------------------------------ model

    def configure_model(self) -> None:
        """Load the HF model (float32 master weights) once; Lightning calls this before fit.

        With ``lora`` the model is wrapped by peft (a ``PeftModel``: base weights frozen, adapters
        trainable, B = 0 so the wrapped model starts exactly as the base model).

        Under ``ModelParallelStrategy`` (FSDP2; the strategy gives the module a device mesh) the
        model -- after the peft wrap -- and the KL reference model are sharded with
        ``fully_shard`` per decoder layer and at the root (:func:`astralight.trainer.fsdp2.shard`; the
        trainer's ``precision`` maps onto FSDP2's mixed precision as documented there), and only
        global rank zero reads the weights. Lightning's ``FSDPStrategy`` (FSDP1) is refused
        (:func:`astralight.trainer.fsdp2.refuse_fsdp1`: it cannot run several forward/backward passes
        per step). :func:`astralight.policy.causal_lm.build_policy_models` does the work.
        """
        if self.model is not None:
            return
        built = build_policy_models(
            self.model_path, disable_dropout=self.disable_dropout,
            gradient_checkpointing=self.gradient_checkpointing, lora_spec=self.lora_spec,
            seed=self.seed,
            with_reference=self.kl_coef > 0 and not self._ref and self.lora_spec is None,
            trainer=self.trainer if self._trainer is not None else None, module=self)
        self.weights_source = built.weights_source
        self._sharded = built.sharded
        self.model = built.model
        if built.ref is not None:
            self._ref.append(built.ref)

    @property
    def ref_model(self) -> torch.nn.Module | None:
        """The frozen initial model for the KL penalty (``None`` when ``kl_coef == 0``, and with
        ``lora``, whose reference is :attr:`model` with its adapters disabled)."""
        return self._ref[0] if self._ref else None

    @property
    def lora_publish(self) -> str | None:
        """``"adapter"`` or ``"merged"`` for a LoRA policy (read by the WeightPublisher), else None."""
        return self.lora_spec.publish if self.lora_spec is not None else None

    def on_fit_start(self) -> None:
        torch.manual_seed(self.seed)
        if self._ref and not self._sharded:  # fully_shard already put the shards on the mesh's device
            self._ref[0].to(self.device)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                mask: Tensor | None = None) -> Tensor:
        """Log-prob of every next token at the module temperature: ``[B, T-1]``. With ``mask``
        (the trained targets, ``[B, T-1]``) the columns before its first trained one may be 0:
        the output projection skips them (:func:`~astralight.rl.logprobs.causal_lm_next_logits`)."""
        return causal_lm_logprobs(self.model, input_ids, attention_mask, self.temperature,
                                  self.logprob_chunk_tokens, first_trained_target(mask))

    def logprobs_with_entropy(self, input_ids: Tensor, attention_mask: Tensor | None,
                              mask: Tensor, grad: bool = False) -> tuple[Tensor, Tensor, int]:
        """:meth:`forward` plus the policy's entropy from the same logits (no second forward):
        ``(logp [B, T-1], sum of per-token entropies over mask, masked token count)``; the
        entropy is that of the sampling distribution (at the temperature), without gradient
        unless ``grad`` (the entropy bonus)."""
        logits, start = causal_lm_next_logits(self.model, input_ids, attention_mask,
                                              first_trained_target(mask))
        logp = token_logprobs(logits, input_ids[:, start + 1:], self.temperature,
                              self.logprob_chunk_tokens)
        entropy, count = masked_entropy_sum(logits, mask[:, start:], self.temperature,
                                            self.logprob_chunk_tokens, grad=grad)
        return pad_to_targets(logp, start), entropy, count

    def save_pretrained(self, path: str) -> None:
        """Save the current weights as a Hugging Face folder (plus the tokenizer of ``model_path``);
        a LoRA policy saves its adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``).

        Under FSDP2 every rank must call it (the shards are gathered tensor by tensor into rank
        zero's host memory) and rank zero writes the folder."""
        save_model_folder(self.model, self.model_path, path, self._sharded)

    # ------------------------------------------------------------------ optimizer

    def configure_optimizers(self):
        """AdamW (``lr``, ``betas``, ``weight_decay``) with ``warmup_steps`` of linear warm-up,
        over the trainable parameters (a LoRA policy: the adapters only).

        ``optimizer`` (``{class_path, init_args}``; ``astralight fit --optimizer``) replaces
        AdamW: it is built over the same parameters with its own ``init_args`` (its ``lr`` there,
        not the module's). ``lr_scheduler`` (``astralight fit --lr_scheduler``) replaces the
        warm-up; it is stepped once per optimizer step, so ``T_max`` / ``total_iters`` count
        optimizer steps."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        return build_optimizers(params, optimizer_spec=self.optimizer_spec,
                                lr_scheduler_spec=self.lr_scheduler_spec, lr=self.lr,
                                betas=self.betas, weight_decay=self.weight_decay,
                                warmup_steps=self.warmup_steps)

    # ------------------------------------------------------------------ batch handling

    def check_batch(self, batch: dict) -> None:
        """Refuse a batch this module cannot train on correctly, naming the field and the fix."""
        batch_ops.check_batch(batch, self.model_id, self.temperature)

    def prepare_batch(self, batch: dict) -> dict[str, Any]:
        """Shift the trainer batch to next-token targets (``[:, 1:]``) and attach advantages.

        Tensors (all shifted, aligned with ``logp``): ``mask``, ``logp_behaviour``,
        ``versions``, per-token ``advantages``; per sample ``sample_advantages``, ``rewards``
        and ``group_ids`` (long ``[b]``: samples of the same task share an id, numbered in order
        of first appearance: what a group baseline such as leave-one-out groups by). The group
        structure and provenance of the batch are kept as they came from
        :func:`astralight.datamodules.rollout.collate_batch`: ``task_ids`` and ``metadata``
        (lists, one entry per sample, sliced with the micro-batch), ``batch_id``, ``model_id``,
        ``policy_version``, ``trainer_version`` (plain values). Override it to add fields; keep
        the ones documented here (the base class and :meth:`compute_loss` read them).
        """
        return batch_ops.prepare_batch(batch, self.normalize_advantages)

    def _micro_slices(self, n: int) -> list[slice]:
        return batch_ops.micro_slices(n, self.micro_batch_size)

    @staticmethod
    def _slice(batch: dict, sl: slice, n: int) -> dict:
        """One micro-batch (:func:`astralight.policy.batch.slice_batch`)."""
        return batch_ops.slice_batch(batch, sl, n)

    # ------------------------------------------------------------------ objective

    def loss_context(self, batch: dict, logp: Tensor) -> dict[str, Any]:
        """Whole-batch quantities fixed before any backward (``logp`` is detached, ``[B, T-1]``).

        Called once per optimizer batch (before the first micro-batch), so it is also the place
        for per-batch state of an objective (e.g. a running baseline); extend it with
        ``ctx = super().loss_context(batch, logp)``. Returns ``n_tokens`` / ``n_samples`` (loss
        tokens / samples over all ranks / world size, so DDP's gradient average equals the mean
        over the global batch), this batch's KL coefficient (``kl_coef``, see
        :meth:`current_kl_coef`) and, if it is above 0, the reference log-probs (``ref_logp``).
        Tensors with the batch as first dim are sliced per micro-batch.
        """
        mask = batch["mask"]
        local = torch.stack([mask.sum().to(torch.float32),
                             torch.tensor(float(mask.shape[0]), device=mask.device)])
        world = max(1, self.trainer.world_size if self._trainer is not None else 1)
        total = all_reduce_sum(local)
        ctx: dict[str, Any] = {"n_tokens": total[0] / world, "n_samples": total[1] / world}
        ctx["kl_coef"] = self.current_kl_coef()
        if ctx["kl_coef"] > 0:
            ctx["ref_logp"] = self._reference_logprobs(batch)
        return ctx

    def current_kl_coef(self) -> float:
        """The KL coefficient of this optimizer batch: ``kl_coef``, or with ``kl_decay_steps``
        its linear decay to 0 over that many ``global_step``s."""
        if self.kl_coef <= 0 or self.kl_decay_steps == 0:
            return self.kl_coef
        step = self.trainer.global_step if self._trainer is not None else 0
        return self.kl_coef * max(0.0, 1.0 - step / self.kl_decay_steps)

    @torch.no_grad()
    def _reference_logprobs(self, batch: dict) -> Tensor:
        ref, ctx = self.ref_model, contextlib.nullcontext()
        if ref is None and self.lora_spec is not None:
            # LoRA: the initial policy is the base model, i.e. this model with adapters off
            ref, ctx = self.model, self.model.disable_adapter()
        n = batch["input_ids"].shape[0]
        with ctx:
            parts = [causal_lm_logprobs(ref, batch["input_ids"][sl], batch["attention_mask"][sl],
                                        self.temperature, self.logprob_chunk_tokens,
                                        first_trained_target(batch["mask"][sl]))
                     for sl in self._micro_slices(n)]
        return torch.cat(parts)

    def compute_loss(self, batch: dict, logp: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """The objective on one (micro-)batch: **the one method a subclass implements**.

        Args:
            batch: the prepared (micro-)batch plus the :meth:`loss_context` entries; all tensors
                shifted to next-token targets and aligned with ``logp``: ``mask`` (bool
                ``[b, T-1]``, the trained tokens), ``logp_behaviour`` (``[b, T-1]``, the
                sampler's log-probs, 0 off mask), ``advantages`` (per token, 0 off mask),
                ``versions`` (policy version per token), ``sample_advantages``, ``rewards`` and
                ``group_ids`` (``[b]``), ``input_ids`` / ``attention_mask`` (unshifted
                ``[b, T]``), ``task_ids`` / ``metadata`` (lists of ``b``), ``policy_version`` /
                ``trainer_version``, and the normalisers ``n_tokens`` / ``n_samples`` of the
                whole optimizer batch (see :meth:`prepare_batch`).
            logp: the current policy's log-prob of every next token, ``[b, T-1]``, with grad,
                at the module temperature.

        Returns:
            ``(loss, metrics)``: a scalar loss to minimise, normalised by the whole batch's
            ``n_tokens`` or ``n_samples`` (not the micro-batch's) so micro-batch losses add up;
            and a dict of scalar metrics logged as ``train/<name>`` (detach them).
        """
        raise NotImplementedError(f"{type(self).__qualname__}.compute_loss")

    compute_loss._rl_policy_abstract = True  # checked in __init__: a subclass must override it

    def objective(self, batch: dict, logp: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """:meth:`compute_loss` plus the KL penalty to the reference model (while
        :meth:`current_kl_coef` is above 0) and the unlikelihood of negative samples (if
        ``unlikelihood_coef > 0``)."""
        loss, metrics = self.compute_loss(batch, logp)
        coef = batch.get("kl_coef", self.kl_coef)
        if coef > 0:
            kl_loss, kl_metrics = kl_penalty(logp, batch["ref_logp"], batch["mask"], coef,
                                             batch["n_tokens"])
            loss = loss + kl_loss
            metrics = {**metrics, **kl_metrics}
        if self.kl_decay_steps:
            metrics["kl_coef"] = torch.tensor(float(coef))
        if self.unlikelihood_coef > 0:
            ul_loss, ul_metrics = unlikelihood_penalty(
                logp, batch["mask"], batch["sample_advantages"], self.unlikelihood_coef,
                batch["n_samples"])
            loss = loss + ul_loss
            metrics = {**metrics, **ul_metrics}
        return loss, metrics

    # ------------------------------------------------------------------ step

    def _backward(self, loss: Tensor, sync: bool) -> None:
        """Backward of one micro-batch; under DDP the gradient all-reduce waits for the last.

        Only a real ``DistributedDataParallel`` gets ``no_sync``. Lightning's check is duck-typed
        and also matches FSDP, whose ``no_sync`` refuses to run inside its own forward -- where
        Lightning runs ``training_step`` (forward redirection; FSDP1 is refused at setup for
        this reason). FSDP2 (``ModelParallelStrategy``) has no root wrapper and reduce-scatters
        every micro-batch's gradient into its sharded ``.grad`` (accumulating), so gradients
        never exist unsharded.
        """
        if self._trainer is None:
            loss.backward()
            return
        strategy = self.trainer.strategy
        ddp = isinstance(getattr(strategy, "model", None), torch.nn.parallel.DistributedDataParallel)
        ctx = strategy.block_backward_sync() if (not sync and ddp) else contextlib.nullcontext()
        with ctx:
            self.manual_backward(loss)

    def accumulate_gradients(self, batch: dict,
                             weights_version: int | None = None) -> dict[str, Tensor]:
        """Forward + backward of a prepared batch (micro-batched); returns combined metrics.

        Gradients accumulate into ``.grad``; the caller clips and steps. Usable without a
        Trainer (plain ``loss.backward()``), which is how the tests compare micro-batching to
        the single pass. ``entropy`` is the policy's mean entropy per loss-masked token of this
        rank's batch, from the logits of the pass that fixes the loss context (the grad forward
        without micro-batches, the no-grad one with them): no extra forward. With
        ``weights_version`` (the published version of the weights as they are now) the
        ``mismatch_*`` metrics (:mod:`astralight.rl.mismatch`) compare those log-probs with the
        behaviour log-probs of the tokens that version sampled.
        """
        n = batch["input_ids"].shape[0]
        slices = self._micro_slices(n)
        bonus = self.entropy_coef > 0
        if len(slices) == 1:
            logp, entropy, count = self.logprobs_with_entropy(
                batch["input_ids"], batch["attention_mask"], batch["mask"], grad=bonus)
            full = {**batch, **self.loss_context(batch, logp.detach())}
            loss, metrics = self._with_entropy_bonus(full, *self.objective(full, logp), entropy)
            self._backward(loss, sync=True)
            out = {k: torch.as_tensor(v).detach().float() for k, v in metrics.items()}
            out["loss"] = loss.detach().float()
            out["entropy"] = entropy.detach() / max(1, count)
            return {**out, **self._mismatch(batch, logp, weights_version)}
        with torch.no_grad():
            passes = [self.logprobs_with_entropy(batch["input_ids"][sl],
                                                 batch["attention_mask"][sl], batch["mask"][sl])
                      for sl in slices]
        logp_all = torch.cat([lp for lp, _, _ in passes])
        entropy = torch.stack([e for _, e, _ in passes]).sum() / max(1, sum(c for *_, c in passes))
        full = {**batch, **self.loss_context(batch, logp_all)}
        total_loss = torch.zeros((), device=logp_all.device)
        parts: list[tuple[float, dict[str, Tensor]]] = []
        for i, sl in enumerate(slices):
            micro = self._slice(full, sl, n)
            if bonus:
                logp, micro_entropy, _ = self.logprobs_with_entropy(
                    micro["input_ids"], micro["attention_mask"], micro["mask"], grad=True)
                loss, metrics = self._with_entropy_bonus(
                    micro, *self.objective(micro, logp), micro_entropy)
            else:
                logp = self(micro["input_ids"], micro["attention_mask"], micro["mask"])
                loss, metrics = self.objective(micro, logp)
            self._backward(loss, sync=i == len(slices) - 1)
            total_loss = total_loss + loss.detach().float()
            parts.append((float(micro["mask"].sum()), metrics))
        out = combine_metrics(parts)
        out["loss"] = total_loss
        out["entropy"] = entropy
        return {**out, **self._mismatch(batch, logp_all, weights_version)}

    @staticmethod
    def _mismatch(batch: dict, logp: Tensor, weights_version: int | None) -> dict[str, Tensor]:
        """The ``mismatch_*`` metrics of ``logp`` (computed by the weights of
        ``weights_version``); none when that version is unknown."""
        if weights_version is None:
            return {}
        return mismatch_metrics(logp, batch["logp_behaviour"], batch["mask"], batch["versions"],
                                weights_version)

    def _with_entropy_bonus(self, batch: dict, loss: Tensor, metrics: dict,
                            entropy_sum: Tensor) -> tuple[Tensor, dict]:
        """``loss - entropy_coef * entropy_sum / n_tokens`` (the bonus, normalised by the whole
        batch's tokens like every loss, so micro-batches add up) and its ``entropy_loss``
        metric; the loss unchanged when ``entropy_coef`` is 0."""
        if self.entropy_coef <= 0:
            return loss, metrics
        bonus = -self.entropy_coef * entropy_sum / batch["n_tokens"]
        return loss + bonus, {**metrics, "entropy_loss": bonus.detach()}

    def _clip_and_norm(self) -> Tensor:
        """Clip to ``grad_clip`` by the global norm over all ranks' gradients (FSDP2 DTensor
        shards included: :func:`astralight.trainer.fsdp2.clip_grad_norm`) and return that norm."""
        from astralight.trainer.fsdp2 import clip_grad_norm

        params = [p for p in self.model.parameters() if p.grad is not None]
        return clip_grad_norm(params, self.grad_clip or None, device=self.device)

    def update_slices(self, n: int) -> list[slice]:
        """The parts of a batch of ``n`` samples that get one optimizer update each, in order,
        for one pass (:attr:`minibatches` contiguous parts; the first ones one sample larger
        when ``n`` does not divide)."""
        if n < self.minibatches:
            raise ValueError(
                f"minibatches: {self.minibatches} updates per pass need at least that many "
                f"samples, but this batch has {n}; lower model.init_args.minibatches or raise "
                "the datamodule's batch_size")
        return batch_ops.even_slices(n, self.minibatches)

    def _optimizer_update(self, opt, last: bool) -> Tensor:
        """Clip, step and zero the gradients; returns the clipped-before norm. Only the batch's
        last update goes through the LightningOptimizer (which counts ``global_step``); the
        others go straight to the strategy, so the precision plugin still wraps them. With
        :attr:`skip_empty_updates` an all-zero gradient is dropped (``grad = None``) before the
        step: torch optimizers skip parameters without a gradient, so their state (momentum,
        second moment, step count) and the weights stay as they are, while the step is still
        counted."""
        grad_norm = self._clip_and_norm()
        if self.skip_empty_updates and float(grad_norm) == 0.0 and not self._grad_scaler():
            opt.zero_grad(set_to_none=True)
        if last:
            opt.step()
        else:
            self.trainer.strategy.optimizer_step(opt.optimizer, do_nothing_closure)
        opt.zero_grad(set_to_none=True)
        sched = self.lr_schedulers()
        if sched is not None:
            sched.step()
        return grad_norm

    def _grad_scaler(self) -> bool:
        """Whether the precision plugin steps through a gradient scaler (fp16 mixed precision),
        which refuses to step an optimizer that has no gradients."""
        plugin = getattr(self.trainer.strategy, "precision_plugin", None)
        return getattr(plugin, "scaler", None) is not None

    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        t0 = time.perf_counter()
        self.check_batch(batch)
        prepared = self.prepare_batch(batch)
        n = prepared["input_ids"].shape[0]
        opt = self.optimizers()
        lr = float(opt.param_groups[0]["lr"])  # the rate this batch's first update uses
        parts = self.update_slices(n)
        plan = [sl for _ in range(self.batch_passes) for sl in parts]
        updates: list[tuple[dict[str, Tensor], Tensor]] = []
        for i, sl in enumerate(plan):
            part = prepared if len(plan) == 1 else self._slice(prepared, sl, n)
            # only the first update sees the weights of a published version (the step's own)
            step_metrics = self.accumulate_gradients(
                part, weights_version=prepared.get("trainer_version") if i == 0 else None)
            updates.append((step_metrics, self._optimizer_update(opt, last=i == len(plan) - 1)))
        metrics = updates[0][0] if len(updates) == 1 else mean_over_updates(
            [m for m, _ in updates])
        norms = torch.stack([g.detach().float() for _, g in updates])
        grad_norm = norms.mean()

        now = time.perf_counter()
        wait_s = float(batch.get("wait_s", 0.0) or 0.0)
        compute_s = now - t0
        interval = (now - self._last_step_end) if self._last_step_end is not None else compute_s + wait_s
        self._last_step_end = now
        # Acknowledge only once the optimizer step has happened: a crash before it re-serves.
        dm = getattr(self.trainer, "datamodule", None)
        if dm is not None and hasattr(dm, "acknowledge") and batch.get("batch_id") is not None:
            dm.acknowledge(batch["batch_id"], wait_s=wait_s, step_s=interval)

        metrics.update(self._batch_stats(batch, prepared))
        metrics["grad_norm"] = grad_norm
        # the share of this batch's updates with no gradient at all (skipped or, with
        # skip_empty_updates false, stepped on momentum alone)
        metrics["empty_update_fraction"] = (norms == 0).float().mean()
        metrics["lr"] = torch.tensor(lr)
        if len(plan) > 1:
            metrics["updates"] = torch.tensor(float(len(plan)))
        n_samples = n
        logged = {f"train/{k}": v for k, v in metrics.items() if k != "loss"}
        logged.update(perf_metrics(prepared, wait_s, compute_s, interval))
        logged.update({f"agent/{k}": float(v) for k, v in (batch.get("agent_stats") or {}).items()})
        self.log_dict(logged, on_step=True, on_epoch=False, batch_size=n_samples)
        self.log("train/loss", metrics["loss"], prog_bar=True, on_step=True, on_epoch=False,
                 batch_size=n_samples)
        return metrics["loss"]

    @staticmethod
    def staleness_reference(batch: dict) -> int | None:
        """The version staleness is measured against: the batch's ``trainer_version``, else
        the ``policy_version`` the dataflow served it at; None if neither is there
        (:func:`astralight.policy.metrics.staleness_reference`)."""
        return _staleness_reference(batch)

    def _batch_stats(self, batch: dict, prepared: dict) -> dict[str, Tensor]:
        """Reward, advantage and staleness statistics of the batch (detached scalars), the
        staleness against :meth:`staleness_reference` (:func:`astralight.policy.metrics.batch_stats`)."""
        return batch_stats(batch, prepared, self.staleness_reference(batch))
