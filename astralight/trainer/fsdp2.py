"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for the policy modules, under Lightning's
``ModelParallelStrategy``.

Why FSDP2 and not Lightning's ``FSDPStrategy`` (FSDP1): the policy uses manual optimization
(a no-grad pass, then several forward/backward micro-batches, then one clip + step). Lightning
runs ``training_step`` inside the root FSDP1 module's forward (forward redirection), and several
forward/backward passes inside it break FSDP1's state machine ("Expects BACKWARD_PRE or
BACKWARD_POST state but got HandleTrainingState.FORWARD", Lightning issues #19685 and
#19626). ``ModelParallelStrategy`` has no root wrapper: the
module shards itself in ``configure_model`` with ``fully_shard`` and ``training_step`` is a
plain call, so any number of forward/backward passes per step works.

What this module does (one job each):

* :func:`data_parallel_mesh` -- the 1-D data-parallel mesh Lightning gives the module
  (``None`` under every other strategy); tensor parallelism is refused (not implemented);
* :func:`mixed_precision_policy` -- how the trainer's ``precision`` maps onto FSDP2:

  ============  ===========================================================================
  precision     FSDP2
  ============  ===========================================================================
  32-true       fp32 everything (no policy)
  bf16-mixed    fp32 sharded master weights and optimizer state;
                ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: parameters are
                all-gathered in bf16 (half the traffic) and compute runs in bf16, gradients
                are reduce-scattered in fp32. Lightning's autocast stays on around
                ``training_step``; it finds bf16 weights already and casts nothing again
                (no double cast), and it keeps its fp32 list (softmax, log-softmax) in fp32.
  bf16-true,    the model is cast to that dtype before sharding (masters in bf16/fp16; AdamW's
  16-true       ~lr-sized updates can vanish below half an ulp -- the shipped configs use
                bf16-mixed); Lightning's later module cast is then a no-op
  ============  ===========================================================================

* :func:`shard` -- ``fully_shard`` on every decoder layer (the classes the HF model lists in
  ``_no_split_modules``, generic for Llama/Qwen-style models; a peft model's base model is
  searched) and then on the model itself (embeddings, final norm, head; tied embeddings stay
  tied, both in the root group). Wrap with peft *before* sharding;
* :func:`shard_from_rank0` -- :func:`shard` where only global rank zero read the weights
  (:func:`reads_weights`) and the other ranks built the model on the meta device: the shards
  are broadcast from rank zero (one full copy in host memory at start-up, not one per rank);
* :func:`clip_grad_norm` -- global gradient norm and clipping over DTensor (sharded) and plain
  gradients, correct for any mix of them;
* :func:`refuse_fsdp1` -- the clear error for ``FSDPStrategy``.

Gradients: with FSDP2 each micro-batch's backward reduce-scatters its gradient into the sharded
``.grad`` (accumulated there), so gradients stay sharded (the memory intent of FULL_SHARD); there
is no ``no_sync`` step skipping (that would keep an unsharded gradient copy per rank).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

#: The Lightning issue that explains why FSDP1 cannot run manual-optimization steps.
LIGHTNING_ISSUE = "https://github.com/Lightning-AI/pytorch-lightning/issues/19685"


def refuse_fsdp1(strategy: Any) -> None:
    """Raise a ValueError naming the fix when ``strategy`` is Lightning's FSDP1 strategy."""
    try:
        from lightning.pytorch.strategies import FSDPStrategy
    except ImportError:  # pragma: no cover - lightning always has it
        return
    if isinstance(strategy, FSDPStrategy):
        raise ValueError(
            "trainer.strategy: FSDPStrategy (FSDP1) cannot train an astralight policy: the policy "
            "runs several forward/backward passes per step (manual optimization), and Lightning "
            "runs training_step inside the root FSDP1 module's forward, which breaks FSDP1's "
            f"state machine (Lightning issue #19685, also #19626: {LIGHTNING_ISSUE}). Use FSDP2: "
            "strategy: {class_path: lightning.pytorch.strategies.ModelParallelStrategy, "
            "init_args: {data_parallel_size: <GPUs of this trainer>, tensor_parallel_size: 1}} "
            "(the policy shards itself per decoder layer), or DDPStrategy for a model that fits "
            "on one GPU")


def data_parallel_mesh(module: Any):
    """The data-parallel ``DeviceMesh`` of a LightningModule under ``ModelParallelStrategy``,
    else ``None``. Refuses a tensor-parallel size above 1 (not implemented for the policy)."""
    mesh = getattr(module, "_device_mesh", None)
    if mesh is None:
        return None
    names = tuple(mesh.mesh_dim_names or ())
    if "tensor_parallel" in names and mesh["tensor_parallel"].size() > 1:
        raise ValueError(
            f"trainer.strategy.tensor_parallel_size: {mesh['tensor_parallel'].size()} is not "
            "supported by astralight's policies (they shard with FSDP2 only); set "
            "tensor_parallel_size: 1 and data_parallel_size to the number of GPUs")
    return mesh["data_parallel"] if "data_parallel" in names else mesh


_TRUE_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16}


def true_dtype(precision: str | None) -> torch.dtype | None:
    """The storage dtype of a ``*-true`` precision (``None`` for mixed and 32-bit)."""
    return _TRUE_DTYPES.get(str(precision))


def mixed_precision_policy(precision: str | None):
    """The FSDP2 ``MixedPrecisionPolicy`` for a Lightning ``precision`` string (see the module
    docstring); ``None`` means FSDP2's default (no casting)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    precision = str(precision)
    if precision in ("32-true", "32", "None"):
        return None
    if precision in ("bf16-mixed", "bf16"):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if precision in _TRUE_DTYPES:
        return None  # the module itself is in that dtype
    raise ValueError(f"trainer.precision: {precision!r} is not supported with FSDP2 here; use "
                     "bf16-mixed (recommended), 32-true, bf16-true or 16-true")


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    get_base = getattr(model, "get_base_model", None)  # peft
    return get_base() if callable(get_base) else model


def layer_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers to shard one by one: modules whose class the HF model names in
    ``_no_split_modules`` (e.g. ``Qwen3DecoderLayer``, ``LlamaDecoderLayer``)."""
    names = set(getattr(_base_model(model), "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"model: {type(_base_model(model)).__name__} names no layer classes in "
            f"_no_split_modules ({sorted(names)}) that occur in it, so it cannot be sharded per "
            "layer; use a Hugging Face causal LM that sets _no_split_modules (Llama/Qwen do)")
    return layers


def shard(model: torch.nn.Module, mesh, precision: str | None,
          reshard_after_forward: bool = True) -> int:
    """``fully_shard`` every decoder layer of ``model``, then ``model`` (in place); returns the
    number of layer units. A frozen model (e.g. the KL reference) is sharded the same way."""
    from torch.distributed.fsdp import fully_shard

    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    policy = mixed_precision_policy(precision)
    if policy is not None:
        kwargs["mp_policy"] = policy
    layers = layer_modules(model)
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return len(layers)


def reads_weights(mesh) -> bool:
    """Whether this process reads the model's weights from disk: always without a mesh or
    distributed run, else only global rank zero (:func:`shard_from_rank0` sends the others their
    shards)."""
    import torch.distributed as dist

    if mesh is None or not dist.is_available() or not dist.is_initialized():
        return True
    return dist.get_world_size() == 1 or dist.get_rank() == 0


def shard_from_rank0(model: torch.nn.Module, mesh, precision: str | None,
                     device: torch.device) -> int:
    """:func:`shard` ``model`` where only global rank zero holds real weights and every other
    rank built the same model on the meta device; afterwards every rank holds its shard of rank
    zero's weights (and rank zero's buffers). Returns the number of layer units.

    Why: loading the full fp32 model on every rank costs world-size full copies of host memory at
    start-up (a 14B policy on 8 GPUs of one machine: 8 x 56 GB); this way one copy is read, and a
    rank other than zero holds its shards plus one full tensor (the one being broadcast) at most.

    How: rank zero keeps references to its full tensors (``state_dict()`` before sharding);
    every rank shards; the meta ranks allocate their shards (``to_empty``); then
    ``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)`` broadcasts the
    tensors one by one and every rank copies its slice into its shard in place; finally every
    buffer is broadcast too (the non-persistent ones, e.g. the rotary ``inv_freq``, are in no
    state dict and ``to_empty`` left them uninitialised). In a one-process run this is
    :func:`shard`.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return shard(model, mesh, precision)
    rank, world = dist.get_rank(), dist.get_world_size()
    if mesh.size() != world:
        raise ValueError(f"the data-parallel mesh ({mesh.size()} ranks) must span the world "
                         f"({world} ranks) to broadcast the weights from rank 0")
    metas = sorted({n for n, t in _states(model) if t.is_meta})
    if rank == 0 and metas:
        raise ValueError(f"rank 0 must hold the real weights to broadcast; {metas[:3]} are on "
                         "the meta device")
    if rank != 0 and len(metas) != len({n for n, _ in _states(model)}):
        raise ValueError("ranks other than 0 must build the model on the meta device "
                         "(astralight.policy.empty_causal_lm)")
    full = {k: v.detach() for k, v in model.state_dict().items()} if rank == 0 else {}
    units = shard(model, mesh, precision)
    if rank != 0:
        model.to_empty(device=device)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True,
                                                               broadcast_from_rank0=True))
    full.clear()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if buf.device != device:
                raise ValueError(f"buffer {name} is on {buf.device}, expected {device}")
            dist.broadcast(buf, src=0)
    left = [n for n, t in _states(model) if t.is_meta]
    if left:
        raise RuntimeError(f"still on the meta device after the broadcast from rank 0: {left[:5]}")
    return units


def full_state_dict(model: torch.nn.Module) -> dict[str, Tensor]:
    """The whole (unsharded) state dict of a sharded ``model`` on global rank zero, in host
    memory, gathered tensor by tensor; ``{}`` on the other ranks. A collective: every rank of
    the mesh must call it. Tied aliases are left out (:func:`tied_aliases`)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                 cpu_offload=True))
    aliases = tied_aliases(model)
    return {k: v for k, v in state.items() if k not in aliases}


def tied_aliases(model: torch.nn.Module) -> set[str]:
    """Names of parameters that are the same parameter as an earlier name (e.g. ``lm_head.weight``
    tied to ``model.embed_tokens.weight``). Why: a gathered full state dict holds a separate copy
    under each name, so storage identity no longer shows the tie; the module still does."""
    first: dict[int, str] = {}
    aliases = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases.add(name)
        else:
            first[id(param)] = name
    return aliases


def _states(model: torch.nn.Module):
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


def is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - old torch
        return False
    return isinstance(t, DTensor)


def _local(t: Tensor) -> Tensor:
    return t.to_local() if is_dtensor(t) else t


@torch.no_grad()
def clip_grad_norm(parameters, max_norm: float | None, device=None) -> Tensor:
    """Clip gradients to a global L2 norm of ``max_norm`` (``None``/0: no clipping) and return
    the global norm before clipping (a plain float32 tensor, the same on every rank).

    DTensor gradients (FSDP2 shards) contribute their *global* norm (``full_tensor`` of the
    DTensor norm: one all-reduce over the mesh, Replicate placements counted once), plain
    gradients their local norm (replicated ones are identical on every rank); the scale is
    applied to each rank's local shard in place.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros((), device=device)
    sharded = [g for g in grads if is_dtensor(g)]
    plain = [g for g in grads if not is_dtensor(g)]
    sq = []
    if sharded:
        norm = torch.nn.utils.get_total_norm(sharded, 2.0)
        norm = norm.full_tensor() if is_dtensor(norm) else norm
        sq.append(norm.float().pow(2))
    if plain:
        sq.append(torch.nn.utils.get_total_norm(plain, 2.0).float().pow(2).to(
            sq[0].device if sq else plain[0].device))
    total = torch.stack(sq).sum().sqrt()
    if max_norm:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        locals_ = [_local(g) for g in grads]
        by_device: dict[tuple, list[Tensor]] = {}
        for g in locals_:
            by_device.setdefault((g.device, g.dtype), []).append(g)
        for (dev, dtype), group in by_device.items():
            torch._foreach_mul_(group, coef.to(device=dev, dtype=dtype))
    return total


__all__ = ["refuse_fsdp1", "data_parallel_mesh", "mixed_precision_policy", "true_dtype",
           "layer_modules", "shard", "reads_weights", "shard_from_rank0", "full_state_dict",
           "tied_aliases", "clip_grad_norm", "is_dtensor", "LIGHTNING_ISSUE"]
