"""The policy LightningModules: ``RLPolicy`` (the base) and ``M2POPolicy`` (the default objective).

One trainer process per policy (``model_id``). Each training step takes one trainer batch (see
``astralight.datamodules.rollout.collate_batch``: right-padded ``input_ids``, ``loss_mask``, ``behaviour_logprobs``,
``versions``, per-sample ``advantages``), computes the policy's token log-probs at the sampling
temperature, the objective, and takes **one optimizer step**; then it acknowledges the batch to
the dataflow, so a crash before the step re-serves it.

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
:class:`astralight.fsdp2_strategy.FSDP2Strategy` (Lightning's ``ModelParallelStrategy``;
``data_parallel_size: auto`` = every GPU of the trainer, ``tensor_parallel_size: 1``):
:meth:`RLPolicy.configure_model` shards the model (after the peft wrap) and the KL reference with
``fully_shard`` per decoder layer, the trainer's ``precision`` maps onto FSDP2's mixed precision
(``bf16-mixed``: fp32 masters, bf16 all-gather/compute, fp32 reduce; see :mod:`astralight.fsdp2`),
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
``*_max``/``*_min`` by max/min) and are logged as ``train/<name>``. The KL penalty is added by the
base class, so every objective gets it; so are ``train/entropy`` (the policy's entropy per
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
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import time
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from torch import Tensor

from astralight.hf_models import causal_lm_from_pretrained, causal_lm_on_meta, check_model_path
from astralight.lora import LoraSpec, wrap_model
from astralight.protocol import temperature_mismatch
from astralight.rl.advantages import batch_normalize, broadcast_to_tokens
from astralight.rl.entropy import masked_entropy_sum
from astralight.rl.kl import kl_penalty
from astralight.rl.logprobs import causal_lm_logprobs, token_logprobs
from astralight.rl.m2po import (
    all_reduce_sum,
    m2_harmful_clip,
    m2po_harmful_loss,
    m2po_keep_mask,
    m2po_loss,
)
from astralight.rl.ppo import ppo_clip_loss

log = logging.getLogger(__name__)

LOSSES = ("m2po", "m2po_harmful", "ppo_clip")
_BATCH_KEYS = ("input_ids", "attention_mask", "loss_mask", "behaviour_logprobs", "versions",
               "advantages", "rewards")
#: plain (non-tensor) batch values :meth:`RLPolicy.prepare_batch` passes on (None when absent)
_PLAIN_KEYS = ("batch_id", "model_id", "policy_version", "trainer_version")


def _disable_dropout(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def _causal_lm_config(model_path: str, disable_dropout: bool):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    if disable_dropout:
        for name, value in list(vars(config).items()):
            if "dropout" in name and isinstance(value, float):
                setattr(config, name, 0.0)
    return config


def load_causal_lm(model_path: str, disable_dropout: bool = True) -> torch.nn.Module:
    """Load a Hugging Face causal LM folder with float32 master weights (dropout off by default)."""
    config = _causal_lm_config(model_path, disable_dropout)
    model = causal_lm_from_pretrained(model_path, config=config, dtype=torch.float32)
    if disable_dropout:
        _disable_dropout(model)
    return model


def empty_causal_lm(model_path: str, disable_dropout: bool = True) -> torch.nn.Module:
    """The same model as :func:`load_causal_lm` built on the meta device: shapes, names and tied
    weights without memory or weights (no file read). FSDP2 ranks other than zero start from it
    and receive their shards from rank zero (:func:`astralight.fsdp2.shard_from_rank0`)."""
    model = causal_lm_on_meta(_causal_lm_config(model_path, disable_dropout),
                              dtype=torch.float32)
    if disable_dropout:
        _disable_dropout(model)
    return model


def check_class_spec(spec: Any, key: str, base: type) -> dict | None:
    """Check a ``{class_path, init_args}`` spec of a ``base`` subclass (``optimizer``,
    ``lr_scheduler``) when the module is built, not at the first step; returns it normalised
    (a bare class path string is accepted). The error names the key and the fix."""
    if spec is None:
        return None
    if isinstance(spec, str):
        spec = {"class_path": spec}
    if not isinstance(spec, dict) or not isinstance(spec.get("class_path"), str):
        raise ValueError(f"{key}: expected {{class_path: ..., init_args: {{...}}}} naming a "
                         f"{base.__module__}.{base.__qualname__} subclass, got {spec!r}")
    unknown = set(spec) - {"class_path", "init_args"}
    if unknown:
        raise ValueError(f"{key}: unknown keys {sorted(unknown)}; only class_path and init_args")
    init_args = dict(spec.get("init_args") or {})
    path = spec["class_path"]
    module_name, _, name = path.rpartition(".")
    example = ("torch.optim.lr_scheduler.CosineAnnealingLR" if key == "lr_scheduler"
               else "torch.optim.SGD")
    try:
        klass = getattr(importlib.import_module(module_name), name) if module_name else None
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{key}.class_path: cannot import {path!r} ({exc}); name a class by "
                         f"its full import path, e.g. {example}") from None
    if not (isinstance(klass, type) and issubclass(klass, base)):
        raise ValueError(f"{key}.class_path: {path!r} is not a {base.__module__}."
                         f"{base.__qualname__} subclass; name one, e.g. {example}")
    if issubclass(klass, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ValueError(f"{key}.class_path: {path!r} needs a monitored metric, and the policy "
                         "steps its scheduler once per optimizer step without one; name a "
                         f"step-driven scheduler, e.g. {example}")
    return {"class_path": path, "init_args": init_args}


def _build(spec: dict, first):
    """``class_path(first, **init_args)`` of a spec checked by :func:`check_class_spec`."""
    module_name, _, name = spec["class_path"].rpartition(".")
    return getattr(importlib.import_module(module_name), name)(first, **spec["init_args"])


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
    :class:`M2POPolicy`. Name the subclass in the trainer config
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
        temperature: sampling temperature of the behaviour policy; batches whose samples say
            otherwise are refused (their behaviour log-probs would not be comparable).
        lr, weight_decay, betas: AdamW; ``warmup_steps`` of linear warm-up, then constant.
        micro_batch_size: samples per forward/backward; ``None`` = the whole batch at once.
        grad_clip: max global gradient norm (``None`` or 0: no clipping, norm still logged).
        normalize_advantages: renormalise the batch's advantages to zero mean, unit std.
        seed: torch seed set at fit start.
        gradient_checkpointing: trade compute for activation memory in the HF model.
        disable_dropout: zero every dropout of the loaded model (recommended for RL).
        logprob_chunk_tokens: token positions per log-softmax chunk (memory bound; ``None``: auto).
        lora: train a LoRA adapter (peft) instead of all weights, e.g.
            ``{r: 16, alpha: 32, dropout: 0.0, target_modules: [q_proj, v_proj], publish: adapter}``
            (keys and defaults: :class:`astralight.lora.LoraSpec`). Only the adapter parameters
            train. ``publish: adapter`` makes the WeightPublisher send only the adapter tensors
            (PEFT names; the RaaS engine needs ``enable_lora``), ``publish: merged`` the merged
            full weights under the base names. With ``kl_coef > 0`` the KL reference is the base
            model itself with the adapters disabled (no second model is loaded).
        optimizer: ``{class_path, init_args}`` of a ``torch.optim.Optimizer`` that replaces
            AdamW (``lr``, ``betas`` and ``weight_decay`` then do not apply: give them in its
            ``init_args``). ``astralight fit --optimizer SGD --optimizer.lr 0.01`` (or a
            top-level ``optimizer:`` in the trainer YAML) sets it.
        lr_scheduler: ``{class_path, init_args}`` of a ``torch.optim.lr_scheduler.LRScheduler``
            that replaces the warm-up, stepped once per optimizer step (``astralight fit
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
        temperature: float = 1.0,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        warmup_steps: int = 0,
        micro_batch_size: int | None = None,
        grad_clip: float | None = 1.0,
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
        if getattr(cls.compute_loss, "_rl_policy_abstract", False):
            raise TypeError(
                f"{cls.__module__}.{cls.__qualname__} does not implement compute_loss(batch, logp) "
                "-> (loss, metrics): RLPolicy is a base class with no objective. Define "
                "compute_loss in your subclass (see the astralight.policy docstring and "
                "examples/custom_trainer/reinforce.py), or use astralight.policy.M2POPolicy")
        if temperature <= 0:
            raise ValueError(f"temperature: must be > 0, got {temperature}")
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError(f"micro_batch_size: must be >= 1 or None, got {micro_batch_size}")
        if kl_coef < 0:
            raise ValueError(f"kl_coef: must be >= 0, got {kl_coef}")
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
        # then saves them again in the most-derived signature's order (hparams.yaml reads as the
        # subclass's signature, and M2POPolicy's is the order it always had).
        self.save_hyperparameters()
        order = _init_arg_order(cls)
        names = sorted(self.hparams, key=lambda k: order.get(k, len(order)))
        self.hparams.clear()  # save_hyperparameters updates the dict in place: refill it in order
        self.save_hyperparameters(*names)
        check_model_path(model_path, "model.init_args.model_path")
        self.model_path = model_path
        self.model_id = model_id
        self.kl_coef = kl_coef
        self.temperature = temperature
        self.lr = lr
        self.weight_decay = weight_decay
        self.betas = tuple(betas)
        self.warmup_steps = warmup_steps
        self.micro_batch_size = micro_batch_size
        self.grad_clip = grad_clip
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
        ``fully_shard`` per decoder layer and at the root (:func:`astralight.fsdp2.shard`; the
        trainer's ``precision`` maps onto FSDP2's mixed precision as documented there). Lightning's
        ``FSDPStrategy`` (FSDP1) is refused (:func:`astralight.fsdp2.refuse_fsdp1`: it cannot run
        several forward/backward passes per step).
        """
        if self.model is not None:
            return
        from astralight import fsdp2

        precision, mesh = None, None
        if self._trainer is not None:
            fsdp2.refuse_fsdp1(self.trainer.strategy)
            precision = self.trainer.precision
            mesh = fsdp2.data_parallel_mesh(self)
        # Under FSDP2 only global rank zero reads the weights (one full copy in host memory, not
        # one per rank); the other ranks build on the meta device and receive their shards from
        # it (fsdp2.shard_from_rank0).
        reads = fsdp2.reads_weights(mesh)
        build = load_causal_lm if reads else empty_causal_lm
        model = build(self.model_path, self.disable_dropout)
        self.weights_source = "file" if reads else "rank0"
        dtype = fsdp2.true_dtype(precision) if mesh is not None else None
        if dtype is not None:
            model.to(dtype)
        if self.gradient_checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.lora_spec is not None:
            # peft draws lora_A at random: seeded, so runs repeat and every rank starts from the
            # same adapter (FSDP2, unlike DDP, broadcasts nothing; each rank keeps its own shard)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed)
                model = wrap_model(model, self.lora_spec)
        model.train()  # from_pretrained returns eval mode; dropout is already zeroed
        if mesh is not None:  # shard before loading the reference: one full copy at most
            fsdp2.shard_from_rank0(model, mesh, precision, self.trainer.strategy.root_device)
            self._sharded = True
        ref = None
        if self.kl_coef > 0 and not self._ref and self.lora_spec is None:
            ref = build(self.model_path, disable_dropout=True).eval()
            ref.requires_grad_(False)
            if dtype is not None:
                ref.to(dtype)
            if mesh is not None:
                # The reference is sharded like the policy: a full frozen copy per rank would
                # cost the memory FSDP saves (8B in fp32 is 32 GB); its forward all-gathers per
                # layer (no grad, resharded after each layer).
                fsdp2.shard_from_rank0(ref, mesh, precision, self.trainer.strategy.root_device)
        self.model = model
        if ref is not None:
            self._ref.append(ref)

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

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Log-prob of every next token at the module temperature: ``[B, T-1]``."""
        return causal_lm_logprobs(self.model, input_ids, attention_mask, self.temperature,
                                  self.logprob_chunk_tokens)

    def logprobs_with_entropy(self, input_ids: Tensor, attention_mask: Tensor | None,
                              mask: Tensor) -> tuple[Tensor, Tensor, int]:
        """:meth:`forward` plus the policy's entropy from the same logits (no second forward):
        ``(logp [B, T-1], sum of per-token entropies over mask, masked token count)``; the
        entropy is that of the sampling distribution (at the temperature), without gradient."""
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        logits = (out.logits if hasattr(out, "logits") else out[0])[:, :-1]
        logp = token_logprobs(logits, input_ids[:, 1:], self.temperature,
                              self.logprob_chunk_tokens)
        entropy, count = masked_entropy_sum(logits, mask, self.temperature,
                                            self.logprob_chunk_tokens)
        return logp, entropy, count

    def save_pretrained(self, path: str) -> None:
        """Save the current weights as a Hugging Face folder (plus the tokenizer of ``model_path``);
        a LoRA policy saves its adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``).

        Under FSDP2 every rank must call it (the shards are gathered tensor by tensor into rank
        zero's host memory) and rank zero writes the folder."""
        from transformers import AutoTokenizer

        if self._sharded:
            import torch.distributed as dist

            from astralight.fsdp2 import full_state_dict

            state = full_state_dict(self.model)
            if dist.get_rank() == 0:
                self.model.save_pretrained(path, state_dict=state, safe_serialization=True)
                with contextlib.suppress(Exception):
                    AutoTokenizer.from_pretrained(self.model_path).save_pretrained(path)
            dist.barrier()
            return
        self.model.save_pretrained(path, safe_serialization=True)
        with contextlib.suppress(Exception):
            AutoTokenizer.from_pretrained(self.model_path).save_pretrained(path)

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
        if self.optimizer_spec is not None:
            opt = _build(self.optimizer_spec, params)
        else:
            opt = torch.optim.AdamW(params, lr=self.lr, betas=self.betas,
                                    weight_decay=self.weight_decay)
        if self.lr_scheduler_spec is not None:
            sched = _build(self.lr_scheduler_spec, opt)
        else:
            warmup = max(0, int(self.warmup_steps))

            def factor(step: int) -> float:
                return 1.0 if warmup == 0 else min(1.0, (step + 1) / warmup)

            sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # ------------------------------------------------------------------ batch handling

    def check_batch(self, batch: dict) -> None:
        """Refuse a batch this module cannot train on correctly, naming the field and the fix."""
        if type(batch).__name__ == "PendingPull":
            raise TypeError("got an unresolved PendingPull: pass the RolloutDataModule to fit() as "
                            "datamodule=..., not its train_dataloader(), so it can pull batches")
        missing = [k for k in _BATCH_KEYS if k not in batch]
        if missing:
            raise KeyError(f"trainer batch lacks {missing}; see astralight.datamodules.rollout.collate_batch")
        mid = batch.get("model_id")
        if mid is not None and mid != self.model_id:
            raise ValueError(
                f"batch.model_id: got samples of {mid!r} but this module trains {self.model_id!r}; "
                "set the datamodule's and the module's model_id to the same policy")
        temps = batch.get("temperature")
        if temps is not None:
            t = torch.as_tensor(temps, dtype=torch.float64).reshape(-1)
            # the same check the dataflow makes on ingest (its ``temperatures`` config)
            bad = [x for x in t[~torch.isnan(t)].tolist()
                   if temperature_mismatch(x, self.temperature)]
            if bad:
                t_sample = f"{float(bad[0]):g}"
                raise ValueError(
                    f"sample temperature {t_sample} != module temperature {self.temperature:g}: "
                    "the behaviour log-probs were computed at the sampling temperature, so the "
                    "ratio would be wrong; set the policy's temperature (model.init_args."
                    f"temperature={t_sample}) or the workflow's sampling temperature to match")

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
        attention = batch["attention_mask"]
        mask = (batch["loss_mask"][:, 1:] > 0) & (attention[:, 1:] > 0)
        adv = batch["advantages"].float()
        if self.normalize_advantages:  # over the global batch: every rank's share
            adv = batch_normalize(adv, reduce_sum=all_reduce_sum)
        n = batch["input_ids"].shape[0]
        task_ids = list(batch.get("task_ids") or [])
        if len(task_ids) != n:  # a batch built by hand without task ids: every sample its own
            task_ids = [f"sample-{i}" for i in range(n)]
        first: dict[Any, int] = {}
        group_ids = torch.tensor([first.setdefault(t, len(first)) for t in task_ids],
                                 dtype=torch.long, device=batch["input_ids"].device)
        metadata = list(batch.get("metadata") or [])
        if len(metadata) != n:
            metadata = [{} for _ in range(n)]
        return {
            "input_ids": batch["input_ids"],
            "attention_mask": attention,
            "mask": mask,
            "logp_behaviour": batch["behaviour_logprobs"][:, 1:].float(),
            "versions": batch["versions"][:, 1:],
            "advantages": broadcast_to_tokens(adv, mask),
            "sample_advantages": adv,
            "rewards": batch["rewards"].float(),
            "group_ids": group_ids,
            "task_ids": task_ids,
            "metadata": metadata,
            **{key: batch.get(key) for key in _PLAIN_KEYS},
        }

    def _micro_slices(self, n: int) -> list[slice]:
        size = self.micro_batch_size or n
        return [slice(i, min(n, i + size)) for i in range(0, n, size)] or [slice(0, 0)]

    @staticmethod
    def _slice(batch: dict, sl: slice, n: int) -> dict:
        """One micro-batch: every tensor whose first dimension is the batch, and every list of
        one entry per sample (``task_ids``, ``metadata``), sliced; everything else as is."""
        def cut(v):
            if isinstance(v, Tensor) and v.ndim > 0 and v.shape[0] == n:
                return v[sl]
            if isinstance(v, list) and len(v) == n:
                return v[sl]
            return v

        return {k: cut(v) for k, v in batch.items()}

    # ------------------------------------------------------------------ objective

    def loss_context(self, batch: dict, logp: Tensor) -> dict[str, Any]:
        """Whole-batch quantities fixed before any backward (``logp`` is detached, ``[B, T-1]``).

        Called once per optimizer batch (before the first micro-batch), so it is also the place
        for per-batch state of an objective (e.g. a running baseline); extend it with
        ``ctx = super().loss_context(batch, logp)``. Returns ``n_tokens`` / ``n_samples`` (loss
        tokens / samples over all ranks / world size, so DDP's gradient average equals the mean
        over the global batch) and, if ``kl_coef > 0``, the reference log-probs (``ref_logp``).
        Tensors with the batch as first dim are sliced per micro-batch.
        """
        mask = batch["mask"]
        local = torch.stack([mask.sum().to(torch.float32),
                             torch.tensor(float(mask.shape[0]), device=mask.device)])
        world = max(1, self.trainer.world_size if self._trainer is not None else 1)
        total = all_reduce_sum(local)
        ctx: dict[str, Any] = {"n_tokens": total[0] / world, "n_samples": total[1] / world}
        if self.kl_coef > 0:
            ctx["ref_logp"] = self._reference_logprobs(batch)
        return ctx

    @torch.no_grad()
    def _reference_logprobs(self, batch: dict) -> Tensor:
        ref, ctx = self.ref_model, contextlib.nullcontext()
        if ref is None and self.lora_spec is not None:
            # LoRA: the initial policy is the base model, i.e. this model with adapters off
            ref, ctx = self.model, self.model.disable_adapter()
        n = batch["input_ids"].shape[0]
        with ctx:
            parts = [causal_lm_logprobs(ref, batch["input_ids"][sl], batch["attention_mask"][sl],
                                        self.temperature, self.logprob_chunk_tokens)
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
        """:meth:`compute_loss` plus the KL penalty to the reference model (if ``kl_coef > 0``)."""
        loss, metrics = self.compute_loss(batch, logp)
        if self.kl_coef > 0:
            kl_loss, kl_metrics = kl_penalty(logp, batch["ref_logp"], batch["mask"], self.kl_coef,
                                             batch["n_tokens"])
            loss = loss + kl_loss
            metrics = {**metrics, **kl_metrics}
        return loss, metrics

    # ------------------------------------------------------------------ step

    def _backward(self, loss: Tensor, sync: bool) -> None:
        """Backward of one micro-batch; under DDP the gradient all-reduce waits for the last.

        Only a real ``DistributedDataParallel`` gets ``no_sync``. Lightning's check is duck-typed
        and also matches FSDP, whose ``no_sync`` refuses to run inside its own forward -- where
        Lightning runs ``training_step`` (forward redirection), so every FSDP step with
        micro-batches failed ("expected to be in states [IDLE]", found by tests/gpu/check.py).
        FSDP1 is now refused at setup; FSDP2 (``ModelParallelStrategy``) has no root wrapper and
        reduce-scatters every micro-batch's gradient into its sharded ``.grad`` (accumulating),
        so gradients never exist unsharded.
        """
        if self._trainer is None:
            loss.backward()
            return
        strategy = self.trainer.strategy
        ddp = isinstance(getattr(strategy, "model", None), torch.nn.parallel.DistributedDataParallel)
        ctx = strategy.block_backward_sync() if (not sync and ddp) else contextlib.nullcontext()
        with ctx:
            self.manual_backward(loss)

    def accumulate_gradients(self, batch: dict) -> dict[str, Tensor]:
        """Forward + backward of a prepared batch (micro-batched); returns combined metrics.

        Gradients accumulate into ``.grad``; the caller clips and steps. Usable without a
        Trainer (plain ``loss.backward()``), which is how the tests compare micro-batching to
        the single pass. ``entropy`` is the policy's mean entropy per loss-masked token of this
        rank's batch, from the logits of the pass that fixes the loss context (the grad forward
        without micro-batches, the no-grad one with them): no extra forward.
        """
        n = batch["input_ids"].shape[0]
        slices = self._micro_slices(n)
        if len(slices) == 1:
            logp, entropy, count = self.logprobs_with_entropy(
                batch["input_ids"], batch["attention_mask"], batch["mask"])
            full = {**batch, **self.loss_context(batch, logp.detach())}
            loss, metrics = self.objective(full, logp)
            self._backward(loss, sync=True)
            out = {k: torch.as_tensor(v).detach().float() for k, v in metrics.items()}
            out["loss"] = loss.detach().float()
            out["entropy"] = entropy / max(1, count)
            return out
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
            logp = self(micro["input_ids"], micro["attention_mask"])
            loss, metrics = self.objective(micro, logp)
            self._backward(loss, sync=i == len(slices) - 1)
            total_loss = total_loss + loss.detach().float()
            parts.append((float(micro["mask"].sum()), metrics))
        out = _combine_metrics(parts)
        out["loss"] = total_loss
        out["entropy"] = entropy
        return out

    def _clip_and_norm(self) -> Tensor:
        """Clip to ``grad_clip`` by the global norm over all ranks' gradients (FSDP2 DTensor
        shards included: :func:`astralight.fsdp2.clip_grad_norm`) and return that norm."""
        from astralight.fsdp2 import clip_grad_norm

        params = [p for p in self.model.parameters() if p.grad is not None]
        return clip_grad_norm(params, self.grad_clip or None, device=self.device)

    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        t0 = time.perf_counter()
        self.check_batch(batch)
        prepared = self.prepare_batch(batch)
        metrics = self.accumulate_gradients(prepared)

        opt = self.optimizers()
        lr = float(opt.param_groups[0]["lr"])  # the rate this step uses
        grad_norm = self._clip_and_norm()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched = self.lr_schedulers()
        if sched is not None:
            sched.step()

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
        metrics["grad_norm"] = grad_norm.detach().float()
        metrics["lr"] = torch.tensor(lr)
        n_samples = prepared["input_ids"].shape[0]
        n_tokens = float(prepared["attention_mask"].sum())
        perf = {
            "perf/wait_s": wait_s,
            "perf/step_compute_s": compute_s,
            "perf/wait_fraction": wait_s / interval if interval > 0 else 0.0,
            "perf/samples_per_s": n_samples / interval if interval > 0 else 0.0,
            "perf/tokens_per_s": n_tokens / interval if interval > 0 else 0.0,
            "perf/trained_tokens_per_s": float(prepared["mask"].sum()) / interval if interval > 0 else 0.0,
        }
        logged = {f"train/{k}": v for k, v in metrics.items() if k != "loss"}
        logged.update(perf)
        logged.update({f"agent/{k}": float(v) for k, v in (batch.get("agent_stats") or {}).items()})
        self.log_dict(logged, on_step=True, on_epoch=False, batch_size=n_samples)
        self.log("train/loss", metrics["loss"], prog_bar=True, on_step=True, on_epoch=False,
                 batch_size=n_samples)
        return metrics["loss"]

    @staticmethod
    def staleness_reference(batch: dict) -> int | None:
        """The version staleness is measured against: the batch's ``trainer_version`` (the
        version of the weights this step is applied to, stamped by the datamodule from the
        WeightPublisher), else -- no publisher numbers this trainer's weights -- the
        ``policy_version`` the dataflow knew when serving it; None if neither is there."""
        version = batch.get("trainer_version")
        if version is None:
            version = batch.get("policy_version")
        return None if version is None else int(version)

    def _batch_stats(self, batch: dict, prepared: dict) -> dict[str, Tensor]:
        """Reward, advantage and staleness statistics of the batch (detached scalars).

        ``staleness_mean`` / ``staleness_max``: per sample with loss tokens, the reference
        version (:meth:`staleness_reference`) minus the oldest version behind its loss-masked
        tokens; mean / max over those samples. ``policy_version`` is the dataflow's version at
        serving, ``trainer_version`` the trainer's own (when known).
        """
        rewards = prepared["rewards"]
        adv = prepared["sample_advantages"]
        mask = prepared["mask"]
        stats = {
            "reward_mean": rewards.mean(),
            "reward_std": rewards.std(unbiased=False),
            "advantage_mean": adv.mean(),
            "advantage_std": adv.std(unbiased=False),
            "advantage_min": adv.min(),
            "advantage_max": adv.max(),
            "response_tokens_mean": mask.sum(1).float().mean(),
            "zero_advantage_fraction": (adv == 0).float().mean(),
        }
        reference = self.staleness_reference(batch)
        if reference is not None:
            versions = prepared["versions"]
            has = mask.any(1)
            big = torch.iinfo(versions.dtype).max
            oldest = torch.where(mask, versions, torch.full_like(versions, big)).min(1).values
            if bool(has.any()):
                staleness = (reference - oldest[has]).float()
                stats["staleness_mean"] = staleness.mean()
                stats["staleness_max"] = staleness.max()
        if batch.get("policy_version") is not None:
            stats["policy_version"] = torch.tensor(float(batch["policy_version"]))
        if batch.get("trainer_version") is not None:
            stats["trainer_version"] = torch.tensor(float(batch["trainer_version"]))
        return {k: v.detach().float() for k, v in stats.items()}


class M2POPolicy(RLPolicy):
    """Trains one policy with M2PO (or its released variant, or PPO-clip) on dataflow batches.

    An :class:`RLPolicy` whose :meth:`compute_loss` is M2PO; :meth:`loss_context` adds the
    whole-batch M2 selection (or the harmful-token clip range).

    Args:
        model_path: Hugging Face model folder (the same folder the RaaS starts from: version 0).
        model_id: the policy this trainer owns; batches of another ``model_id`` are refused.
        loss: ``"m2po"`` (paper), ``"m2po_harmful"`` (released code's variant) or ``"ppo_clip"``.
        m2_threshold: M2PO's second-moment budget on ``(log r)^2`` (paper default 0.04).
        clip_eps: PPO clip range (``ppo_clip`` only); ``clip_eps_high``: DAPO clip-higher bound.
        harmful_min_eps_low / harmful_min_eps_high: floors on the adaptive clip range of
            ``m2po_harmful`` (the released code's ``miniclip_low/high``; unset in its scripts).
        **kwargs: every other :class:`RLPolicy` argument (``kl_coef``, ``temperature``, ``lr``,
            ``micro_batch_size``, ``lora``, ``optimizer``, ...), passed on unchanged;
            ``astralight fit --model.help astralight.policy.M2POPolicy`` lists them all.
    """

    def __init__(
        self,
        model_path: str,
        model_id: str = "policy",
        loss: Literal["m2po", "m2po_harmful", "ppo_clip"] = "m2po",
        m2_threshold: float = 0.04,
        clip_eps: float = 0.2,
        clip_eps_high: float | None = None,
        harmful_min_eps_low: float | None = None,
        harmful_min_eps_high: float | None = None,
        **kwargs: Any,
    ):
        if loss not in LOSSES:
            raise ValueError(f"loss: {loss!r} is not one of {LOSSES}")
        super().__init__(model_path=model_path, model_id=model_id, **kwargs)
        self.loss_name = loss
        self.m2_threshold = m2_threshold
        self.clip_eps = clip_eps
        self.clip_eps_high = clip_eps_high
        self.harmful_min_eps_low = harmful_min_eps_low
        self.harmful_min_eps_high = harmful_min_eps_high

    def loss_context(self, batch: dict, logp: Tensor) -> dict[str, Any]:
        """The base context plus, per objective, the M2 keep mask (``m2_keep``,
        ``m2_selection``, all-gathered over ranks) or the harmful clip (``harmful_clip``)."""
        ctx = super().loss_context(batch, logp)
        mask = batch["mask"]
        if self.loss_name == "m2po":
            keep, sel = m2po_keep_mask(logp, batch["logp_behaviour"], mask, self.m2_threshold)
            ctx["m2_keep"] = keep
            ctx["m2_selection"] = sel
        elif self.loss_name == "m2po_harmful":
            ctx["harmful_clip"] = m2_harmful_clip(
                logp, batch["logp_behaviour"], batch["advantages"], mask, self.m2_threshold,
                self.harmful_min_eps_low, self.harmful_min_eps_high)
        return ctx

    def compute_loss(self, batch: dict, logp: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """M2PO / M2PO-harmful / PPO-clip on one (micro-)batch, token-mean over ``n_tokens``."""
        mask, n_tokens = batch["mask"], batch["n_tokens"]
        if self.loss_name == "m2po":
            loss, metrics = m2po_loss(
                logp, batch["logp_behaviour"], batch["advantages"], mask, self.m2_threshold,
                keep=batch["m2_keep"], n_tokens=n_tokens, selection=batch["m2_selection"])
            # ``m2`` (this micro-batch's mean (log r)^2) repeats ``m2_before`` (the same over the
            # whole batch, the statistic the selection uses): one tag, not two
            metrics.pop("m2", None)
            return loss, metrics
        if self.loss_name == "m2po_harmful":
            return m2po_harmful_loss(
                logp, batch["logp_behaviour"], batch["advantages"], mask, self.m2_threshold,
                clip=batch["harmful_clip"], n_tokens=n_tokens)
        return ppo_clip_loss(
            logp, batch["logp_behaviour"], batch["advantages"], mask, self.clip_eps,
            self.clip_eps_high, n_tokens=n_tokens)


def _combine_metrics(parts: list[tuple[float, dict[str, Tensor]]]) -> dict[str, Tensor]:
    """Combine micro-batch metrics: ``*_loss`` add up (each is already normalised by the whole
    batch), ``*_max``/``*_min`` take max/min, everything else a token-weighted mean."""
    out: dict[str, Tensor] = {}
    keys = {k for _, m in parts for k in m}
    for key in sorted(keys):
        vals = [(w, torch.as_tensor(m[key]).detach().float()) for w, m in parts if key in m]
        stacked = torch.stack([v for _, v in vals])
        weights = torch.tensor([w for w, _ in vals], device=stacked.device)
        if key.endswith("_loss"):
            out[key] = stacked.sum()
        elif key.endswith("_max"):
            out[key] = stacked.max()
        elif key.endswith("_min"):
            out[key] = stacked.min()
        elif float(weights.sum()) > 0:
            out[key] = (stacked * weights).sum() / weights.sum()
        else:
            out[key] = stacked.mean()
    return out


__all__ = ["RLPolicy", "M2POPolicy", "LOSSES", "load_causal_lm"]
