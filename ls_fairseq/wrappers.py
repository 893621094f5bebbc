"""Seeing through the trainer's model wrappers (fairseq's ModuleProxyWrapper, torch DDP, fairseq's
LegacyDistributedDataParallel): each holds the wrapped model as its ``module`` child. The two
data-parallel wrappers differ in how they say an update's gradients are due for the all-reduce
and over how many workers; ``grad_sync_due`` and ``world_size`` ask either."""
import torch


def find_wrapper(model, types, depth=8):
    """The first module that is an instance of ``types`` on the ``.module`` chain starting at
    ``model`` (``model`` included), or None."""
    seen = model
    for _ in range(depth):
        if isinstance(seen, types):
            return seen
        seen = seen._modules.get("module") if isinstance(seen, torch.nn.Module) else None
        if seen is None:
            return None
    return None


def innermost(model, depth=8):
    """The model inside the trainer's wrappers (the end of the ``.module`` chain)."""
    for _ in range(depth):
        inner = model._modules.get("module") if isinstance(model, torch.nn.Module) else None
        if inner is None:
            return model
        model = inner
    return model


def data_parallel_of(module):
    """The trainer's data-parallel wrapper inside ``module``'s wrapper chain: fairseq's
    LegacyDistributedDataParallel (``--ddp-backend legacy_ddp``/``no_c10d``) or torch's
    DistributedDataParallel (``c10d``/``pytorch_ddp``, fairseq's default), or None."""
    from fairseq.distributed import LegacyDistributedDataParallel

    return find_wrapper(module, (LegacyDistributedDataParallel,
                                 torch.nn.parallel.DistributedDataParallel))


def is_torch_ddp(wrapper) -> bool:
    return isinstance(wrapper, torch.nn.parallel.DistributedDataParallel)


def grad_sync_due(wrapper) -> bool:
    """Whether a backward now ends the update: the gradients are to be all-reduced (False inside
    the wrapper's ``no_sync()``, fairseq's micro-batches before the last of ``--update-freq``)."""
    if is_torch_ddp(wrapper):
        return wrapper.require_backward_grad_sync
    return not wrapper.accumulate_grads


def world_size(wrapper) -> int:
    """The number of workers ``wrapper`` averages the gradients over."""
    if is_torch_ddp(wrapper):
        return torch.distributed.get_world_size(wrapper.process_group)
    return wrapper.world_size
