"""The collective set-up shared by the copy-engine all-reduce (``peer_all_reduce.create``) and the
sharded optimizer step (``sharded_step.create``): every rank decides alike.

NCCL pairs the ranks' collectives by their order, so a set-up that one rank abandons while the
others go on would leave them waiting for good. Each step of a set-up therefore runs as
``attempt`` (a local failure becomes this rank's reason, never an exception between two
collectives), every rank's result is gathered (``everyone``), and the first reason of any rank
(``first_reason``) stops every rank at the same point. ``nbytes`` sizes the views of another
rank's memory opened from its exported CUDA IPC handles.
"""
import torch.distributed as dist


def attempt(fn, what="this rank's check failed"):
    """``(fn(), "")``, or ``(None, reason)`` when it raised: a local failure must still reach
    the next collective, as this rank's reason."""
    try:
        return fn(), ""
    except Exception as exc:  # noqa: BLE001
        return None, f"{what} ({first_line(exc)})"


def first_line(exc) -> str:
    """The first line of an exception's message (or its type's name), for a one-line reason."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def everyone(value, group, world):
    """Every rank's ``value`` (picklable), in rank order, on every rank (collective)."""
    values = [None] * world
    dist.all_gather_object(values, value, group=group)
    return values


def first_reason(values) -> str:
    """The first non-empty ``reason`` among the ranks' dicts."""
    return next((v["reason"] for v in values if v["reason"]), "")


def nbytes(t, numel):
    """Bytes of a view of ``numel`` elements of ``t``'s dtype (at least one element: an empty
    buffer is exported as one)."""
    return max(numel, 1) * t.element_size()
