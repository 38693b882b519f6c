"""``training.parallel: fsdp``: the model sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``)
over the processes of the run, one FSDP unit per block the planners see.

The wrapping order is torchtitan's (``parallelize.py``: activation checkpointing, then per-block
compile, then ``fully_shard`` on each block and on the root), with the planner in the place of
the checkpointing: ``fully_shard`` goes on each block that ``planners.blocks.discover_blocks``
finds, inside out (the blocks first, then the root, which takes what is left: embeddings, head),
and the planner attaches to those same blocks. A block's FSDP unit and its checkpoint are then one
module: the unit's pre-forward hook all-gathers the block's parameters, the planner's forward of
the block (``runners.RoutedForward``) runs it checkpointed or not, and in backward the unit's
pre-backward hook gathers them again before the block's ops are differentiated, which is when a
non-reentrant checkpoint recomputes. The recompute calls the block's forward, not the module, so
no FSDP hook runs in it and nothing is gathered twice. An FSDP unit inside a block (a finer
wrapping) would be gathered again by the recompute: there is none.

Every rank builds the same model from the same seed; rank 0's weights are broadcast before
sharding all the same (as DDP's constructor does), so that a model loaded on each rank from files
is the same too. Each rank keeps its shard (dim 0, ``Shard(0)``) and its shard of the gradients
and of the optimizer's state, which is built on the sharded parameters.

Gradients: each backward reduce-scatters its block's gradient, averaged over the ranks (FSDP's
default divide factor, the world size): with each rank's loss weighted by its share of the global
batch (``distributed.local_batch``), the average is the global batch's mean, as for ``ddp``.
"""

import warnings

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from mimose_cli.planners.blocks import discover_blocks
from mimose_cli.units import format_bytes

PARAM_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
"""The dtype FSDP gathers the parameters in, per ``training.precision`` (None: as stored, fp32)."""


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """FSDP's policy for ``training.precision``: fp32 gathers and reduces in fp32; bf16 and fp16
    gather the parameters in that dtype (the forward runs under the same autocast as one process's)
    and reduce-scatter the gradients in fp32, so that the average over ranks loses no bits the
    one-process run keeps; the sharded parameters, gradients and optimizer state stay fp32."""
    dtype = PARAM_DTYPES[precision]
    if dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def grad_scaler(device: torch.device, sharded: bool):
    """fp16's loss scaler. Sharded, each rank sees only its shard of the gradients, so whether one
    is not finite is agreed over the ranks (``ShardedGradScaler`` all-reduces it) and every rank
    skips the same steps; else torch's ``GradScaler``."""
    return ShardedGradScaler(device.type) if sharded else torch.amp.GradScaler(device.type)


def device_mesh(device: torch.device, world_size: int):
    """The 1-D mesh of every rank, on the run's device type: a CPU run gets a CPU mesh (gloo) also
    on a machine with GPUs, where a mesh left to guess would pick CUDA and gloo would crash."""
    return init_device_mesh(device.type, (world_size,))


def shard_model(model: torch.nn.Module, blocks: list, mesh, precision: str = "fp32",
                reshard_after_forward: bool = True) -> None:
    """``fully_shard`` each of ``blocks`` (``[(name, module)]``, as discovered) and then the root,
    in place. ``reshard_after_forward`` False keeps every unit's gathered parameters from its
    forward to its backward (no second all-gather, more memory); the recompute of a checkpointed
    block reads them as they are either way."""
    policy = mixed_precision(precision)
    for _, block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)


def shard(model: torch.nn.Module, recipe, device: torch.device, world_size: int) -> list:
    """The recipe's model sharded over ``world_size`` ranks (``shard_model`` on its blocks,
    ``recipe.model.blocks`` or discovered); returns the blocks, for the planner to plan the same
    units."""
    blocks = discover_blocks(model, recipe.model.blocks)
    shard_model(model, blocks, device_mesh(device, world_size), recipe.training.precision,
                recipe.training.reshard_after_forward)
    # torch warns at every forward of a root whose output is a view (a multiple-choice head's
    # reshaped logits): an in-place op on it would skip the pre-backward all-gather. The launcher's
    # step reads the loss and writes to no output, so the warning would only alarm.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor", category=UserWarning)
    return blocks


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``model`` or a module in it: its state is saved in shards."""
    return any(isinstance(module, FSDPModule) for module in model.modules())


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds of ``tensor``: its shard for a sharded parameter (a DTensor), else
    all of it."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def largest_block_bytes(blocks: list, precision: str = "fp32") -> int:
    """Bytes of the largest block's parameters gathered (in the dtype ``mixed_precision`` gathers
    them in): what one unit holds unsharded on a rank while it runs, and about as much again for
    its gradients until they are reduce-scattered."""
    dtype = PARAM_DTYPES[precision]

    def gathered(block) -> int:
        return sum(p.numel() * (p.element_size() if dtype is None else dtype.itemsize) for p in block.parameters())

    return max((gathered(block) for _, block in blocks), default=0)


def check_world(world_size: int) -> None:
    """ValueError in one line for ``training.parallel=fsdp`` in one process: there is nothing to
    shard over (one process trains as ``ddp`` does, without FSDP's gathers)."""
    if world_size < 2:
        raise ValueError("training.parallel=fsdp shards the model over several processes, but this run has one: "
                         "run it with --nproc-per-node 2 or more (or under torchrun), or set training.parallel=ddp")


def describe(model: torch.nn.Module, blocks: list, world_size: int) -> str:
    """The sharding a run built, for its setup lines."""
    held = sum(local_bytes(p) for p in model.parameters())
    return (f"fsdp: {len(blocks)} blocks and the root sharded over {world_size} ranks "
            f"({blocks[0][0]}, ...); this rank holds {format_bytes(held)} of the weights")


def held_param_bytes(model: torch.nn.Module) -> int:
    """Bytes of ``model``'s trainable parameters this rank holds (its shards when sharded; all of
    them otherwise): as many again for their gradients, between the steps."""
    return sum(local_bytes(p) for p in model.parameters() if p.requires_grad)
