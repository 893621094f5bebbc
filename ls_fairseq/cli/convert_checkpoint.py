"""Switch the architecture recorded in a fairseq checkpoint between ``ls_`` and fairseq.

The weights need no change (an ls_ model's state_dict has fairseq's keys and shapes); only the
model name and architecture recorded in the checkpoint's config (and legacy ``args``) move, with
the criterion and optimizer names (their state is interchangeable), so training resumes on the
other side without ``--reset-optimizer``::

    ls-fairseq-convert checkpoint_best.pt fairseq_best.pt --to fairseq
    ls-fairseq-convert fairseq_best.pt ls_best.pt --to ls
"""
import argparse
import sys

import torch

from ..checkpoint_compat import allow_fairseq_checkpoints
from ..models.ls_transformer import ARCHITECTURES

PREFIX = "ls_"
#: fairseq component <-> ls_ twin, as recorded in a checkpoint (config names and class names)
TWINS = {
    "label_smoothed_cross_entropy": "ls_label_smoothed_cross_entropy",
    "adam": "ls_adam",
    "LabelSmoothedCrossEntropyCriterion": "LSLabelSmoothedCrossEntropyCriterion",
    "FairseqAdam": "FairseqLSAdam",
}


def convert_name(name, to: str):
    """Criterion/optimizer names: switch to the twin if there is one, else leave unchanged."""
    if to == "ls":
        return TWINS.get(name, name)
    return {v: k for k, v in TWINS.items()}.get(name, name)


def convert_arch(arch: str, to: str) -> str:
    if to == "fairseq":
        if not arch.startswith(PREFIX):
            raise ValueError(f"architecture {arch!r} is not an ls_ architecture")
        return arch[len(PREFIX):]
    if arch.startswith(PREFIX):
        raise ValueError(f"architecture {arch!r} is already an ls_ architecture")
    if PREFIX + arch not in ARCHITECTURES:
        raise ValueError(
            f"fairseq architecture {arch!r} has no ls_ twin; supported: "
            + ", ".join(sorted(a[len(PREFIX):] for a in ARCHITECTURES))
        )
    return PREFIX + arch


def convert_state(state: dict, to: str) -> str:
    """Rewrite the model name/arch in a loaded checkpoint dict in place; returns the new arch."""
    new_arch = None
    cfg = state.get("cfg")
    if cfg is not None and cfg.get("model") is not None:
        model_cfg = cfg["model"]
        old = model_cfg.get("_name") if hasattr(model_cfg, "get") else getattr(model_cfg, "_name")
        new_arch = convert_arch(old, to)
        if isinstance(model_cfg, argparse.Namespace):
            model_cfg._name = model_cfg.arch = new_arch
        else:
            model_cfg["_name"] = new_arch
            if "arch" in model_cfg:
                model_cfg["arch"] = new_arch
    args = state.get("args")
    if args is not None and getattr(args, "arch", None):
        new_arch = convert_arch(args.arch, to)
        args.arch = new_arch
        if to == "fairseq" and hasattr(args, "user_dir"):
            args.user_dir = None
    if to == "fairseq" and cfg is not None and cfg.get("common") is not None:
        # a fairseq-only machine must not need the plugin to load this checkpoint
        cfg["common"]["user_dir"] = None
    if new_arch is None:
        raise ValueError("checkpoint records no model architecture (no cfg.model or args.arch)")
    # the criterion and optimizer state are interchangeable too: switch their recorded names so
    # training resumes without --reset-optimizer
    for section in ("criterion", "optimizer"):
        if cfg is not None and cfg.get(section) is not None and "_name" in cfg[section]:
            cfg[section]["_name"] = convert_name(cfg[section]["_name"], to)
        if args is not None and getattr(args, section, None):
            setattr(args, section, convert_name(getattr(args, section), to))
    for entry in state.get("optimizer_history", []):
        for key in ("criterion_name", "optimizer_name"):
            if key in entry:
                entry[key] = convert_name(entry[key], to)
    return new_arch


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("input", help="fairseq checkpoint (.pt)")
    parser.add_argument("output", help="where to write the converted checkpoint")
    parser.add_argument("--to", choices=["fairseq", "ls"], required=True,
                        help="fairseq: ls_X -> X; ls: X -> ls_X")
    args = parser.parse_args(argv)
    allow_fairseq_checkpoints()
    state = torch.load(args.input, map_location="cpu")
    try:
        new_arch = convert_state(state, args.to)
    except ValueError as exc:
        parser.error(str(exc))
    torch.save(state, args.output)
    print(f"wrote {args.output} with arch {new_arch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
