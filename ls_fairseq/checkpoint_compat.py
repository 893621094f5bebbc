"""Let ``torch.load`` read fairseq checkpoints under torch >= 2.6 (``weights_only=True``), and say
what to do when a checkpoint of the other side's components is resumed.

fairseq 0.12 calls ``torch.load`` without ``weights_only``, and since torch 2.6 that defaults to
the safe unpickler, which refuses the non-tensor objects a fairseq checkpoint holds (its
``argparse.Namespace`` and omegaconf config, counters). Rather than switching the safe loader off
for the whole process (``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``), :func:`fairseq_checkpoint_globals`
allow-lists exactly those types, with torch's documented ``torch.serialization.safe_globals``,
for the loads that read fairseq checkpoints only (``fairseq_patches``, patch 12, and
``ls-fairseq-convert``); tensors and every other type stay under the safe loader's rules, and
outside those loads torch's allow-list is the process's own.

fairseq's trainer refuses to resume a checkpoint whose recorded criterion or optimizer class differs
from the run's, advising ``--reset-optimizer`` (which drops the Adam state). For a fairseq
component against its ls_ twin, :func:`resume_advice` names ``ls-fairseq-convert`` instead
(``ls_fairseq.fairseq_patches``, patch 4, raises it).
"""
import argparse
import collections
import contextlib
import os
import typing

import torch


def fairseq_checkpoint_types():
    types = [argparse.Namespace, collections.defaultdict, collections.OrderedDict, typing.Any,
             dict, list, int, float, str, tuple, set]
    try:
        import omegaconf
        from omegaconf import base, dictconfig, listconfig, nodes

        types += [dictconfig.DictConfig, listconfig.ListConfig, base.ContainerMetadata,
                  base.Metadata, nodes.AnyNode, nodes.StringNode, nodes.IntegerNode,
                  nodes.FloatNode, nodes.BooleanNode, omegaconf.Container]
    except ImportError:  # pragma: no cover - omegaconf is a fairseq dependency
        pass
    try:  # a resume on several workers: rank 0 broadcasts the checkpoint's state, its tensors
        # pickled as placeholders (fairseq.distributed.utils.broadcast_object)
        from fairseq.distributed.utils import _TensorPlaceholder

        types.append(_TensorPlaceholder)
    except ImportError:  # pragma: no cover - fairseq without it pickles no placeholders
        pass
    try:
        import numpy as np

        types += [np.dtype, np.ndarray, type(np.dtype("float64")), type(np.dtype("float32")),
                  type(np.dtype("int64"))]
        core = getattr(np, "_core", None) or np.core
        types += [core.multiarray.scalar, core.multiarray._reconstruct]
    except (ImportError, AttributeError):  # pragma: no cover
        pass
    return types


@contextlib.contextmanager
def fairseq_checkpoint_globals():
    """Inside the block, torch's safe loader also allows the types of fairseq's checkpoints (those
    not allowed already: they are taken off again at its end, the others stay)."""
    scoped = getattr(torch.serialization, "safe_globals", None)
    if scoped is None:  # torch < 2.5 (not safe by default before 2.6): 2.4's process-wide form
        add = getattr(torch.serialization, "add_safe_globals", None)
        if add is not None:
            add(fairseq_checkpoint_types())
        yield
        return
    allowed = set(torch.serialization.get_safe_globals())
    with scoped([t for t in fairseq_checkpoint_types() if t not in allowed]):
        yield


# ---- resuming a checkpoint saved with the other side's components ---------------------------

#: fairseq component <-> ls_ twin, as recorded in a checkpoint (config names and class names);
#: each pair's state is interchangeable. ls_adam's fused fp16 copy (LSFusedFP16Optimizer) keeps
#: fairseq's FP16Optimizer state_dict.
TWINS = {
    "label_smoothed_cross_entropy": "ls_label_smoothed_cross_entropy",
    "adam": "ls_adam",
    "LabelSmoothedCrossEntropyCriterion": "LSLabelSmoothedCrossEntropyCriterion",
    "FairseqAdam": "FairseqLSAdam",
    "FP16Optimizer": "LSFusedFP16Optimizer",
}
#: optimizer class names fairseq's trainer records whose saved state is the same: with or without
#: ls_adam's fused fp16 copy (on by default where it applies, off with --ls-no-fused-fp16-copy)
SAME_STATE_OPTIMIZERS = frozenset({"FP16Optimizer", "LSFusedFP16Optimizer"})


def twin(name: str, to: str) -> str:
    """``name``'s twin on side ``to`` ("ls" or "fairseq"), or ``name`` itself."""
    if to == "ls":
        return TWINS.get(name, name)
    return {v: k for k, v in TWINS.items()}.get(name, name)


def optimizer_names_match(saved: str, current: str) -> bool:
    return saved == current or {saved, current} <= SAME_STATE_OPTIMIZERS


def resume_advice(filename: str, saved_criterion: str, saved_optimizer: str,
                  criterion: str, optimizer: str):
    """What to do when fairseq's trainer refuses to resume ``filename`` because the criterion or
    optimizer class it records differs from this run's (fairseq advises ``--reset-optimizer``,
    which throws the Adam state away). One line, or None when no differing pair is a fairseq
    component and its ls_ twin (fairseq's own message then stands)."""
    pairs = [(saved_criterion, criterion, saved_criterion == criterion),
             (saved_optimizer, optimizer, optimizer_names_match(saved_optimizer, optimizer))]
    differ = [(saved, current) for saved, current, same in pairs if not same]
    if not any(twin(saved, to) != saved and optimizer_names_match(twin(saved, to), current)
               for saved, current in differ for to in ("ls", "fairseq")):
        return None  # no differing pair is a component and its twin: not ours to explain
    for to in ("ls", "fairseq"):
        if twin(saved_criterion, to) == criterion and \
                optimizer_names_match(twin(saved_optimizer, to), optimizer):
            base, ext = os.path.splitext(filename)
            out = f"{base}_{to}{ext or '.pt'}"
            side = "fairseq's" if to == "ls" else "ls_"
            return (f"ls_fairseq: {filename} holds {side} criterion/optimizer state "
                    f"({saved_criterion}, {saved_optimizer}) and this run uses their twins: "
                    f"convert it, keeping the Adam state: ls-fairseq-convert {filename} {out} "
                    f"--to {to}, then resume with --restore-file {out}")
    return (f"ls_fairseq: {filename} holds {saved_criterion} and {saved_optimizer} state, this run "
            f"has {criterion} and {optimizer}: ls-fairseq-convert switches both at once, so "
            "resume with ls_label_smoothed_cross_entropy and ls_adam together, or with neither")
