"""Let ``torch.load`` read fairseq checkpoints under torch >= 2.6 (``weights_only=True``).

fairseq 0.12 calls ``torch.load`` without ``weights_only``, and since torch 2.6 that defaults to
the safe unpickler, which refuses the non-tensor objects a fairseq checkpoint holds (its
``argparse.Namespace`` and omegaconf config, counters). Rather than switching the safe loader off
for the whole process (``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``), this allow-lists exactly those
types with torch's documented ``torch.serialization.add_safe_globals``; tensors and every other
type stay under the safe loader's rules.
"""
import argparse
import collections
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
    try:
        import numpy as np

        types += [np.dtype, np.ndarray, type(np.dtype("float64")), type(np.dtype("float32")),
                  type(np.dtype("int64"))]
        core = getattr(np, "_core", None) or np.core
        types += [core.multiarray.scalar, core.multiarray._reconstruct]
    except (ImportError, AttributeError):  # pragma: no cover
        pass
    return types


def allow_fairseq_checkpoints():
    add = getattr(torch.serialization, "add_safe_globals", None)
    if add is not None:  # torch < 2.4 has no safe loader by default: nothing to do
        add(fairseq_checkpoint_types())
