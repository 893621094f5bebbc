"""Facts about the run's processes, for modules at every layer (no fairseq import)."""
import torch.distributed as dist


def several_workers() -> bool:
    """True inside a distributed run of more than one process (fairseq's trainer then exchanges
    logging outputs and grad norms between them)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
