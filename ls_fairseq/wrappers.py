"""Seeing through the trainer's model wrappers (fairseq's ModuleProxyWrapper, torch DDP, fairseq's
LegacyDistributedDataParallel): each holds the wrapped model as its ``module`` child."""
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


def legacy_ddp_of(module):
    """fairseq's LegacyDistributedDataParallel (``--ddp-backend legacy_ddp``/``no_c10d``) inside
    the trainer's model wrappers, or None (also under torch DDP)."""
    from fairseq.distributed import LegacyDistributedDataParallel

    found = find_wrapper(module, (LegacyDistributedDataParallel,
                                  torch.nn.parallel.DistributedDataParallel))
    return found if isinstance(found, LegacyDistributedDataParallel) else None
