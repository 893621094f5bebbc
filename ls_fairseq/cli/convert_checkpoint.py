"""Switch the architecture recorded in a fairseq checkpoint between ``ls_`` and fairseq.

The weights need no change (an ls_ model's state_dict has fairseq's keys and shapes); only the
model name and architecture recorded in the checkpoint's config (and legacy ``args``) move, with
the criterion and optimizer names (their state is interchangeable), so training resumes on the
other side without ``--reset-optimizer``::

    ls-fairseq-convert checkpoint_best.pt fairseq_best.pt --to fairseq
    ls-fairseq-convert fairseq_best.pt ls_best.pt --to ls

The config is written as plain dicts and lists: the ``argparse.Namespace`` fairseq keeps in
``cfg.model`` becomes a dict, which fairseq's ``load_checkpoint_to_cpu`` turns into a config as it
does with the rest of ``cfg``. So the converted checkpoint loads under torch >= 2.6's
``weights_only=True`` on a machine with plain fairseq, without ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``
(tests/test_convert_checkpoint.py).

Mistakes get one line on stderr and exit status 2, and nothing is written: a missing or
unreadable input, a file that is not a fairseq checkpoint, a missing output folder, an
architecture without a twin. The output is written next to its final name and renamed into place.
torch and fairseq are imported only after the arguments are read (``--help`` needs neither).
"""
import argparse
import os
import re
import sys
import warnings

PREFIX = "ls_"


class ConvertError(Exception):
    """A mistake in the input or output: its message is the one line the user sees."""


def convert_name(name, to: str):
    """Criterion/optimizer names: switch to the twin if there is one, else leave unchanged."""
    from ..checkpoint_compat import twin

    return twin(name, to)


def convert_arch(arch: str, to: str) -> str:
    from ..models.ls_transformer import ARCHITECTURES

    if to == "fairseq":
        if not arch.startswith(PREFIX):
            raise ValueError(f"architecture {arch!r} is not an ls_ architecture (already "
                             "fairseq's?); --to ls converts the other way")
        return arch[len(PREFIX):]
    if arch.startswith(PREFIX):
        raise ValueError(f"architecture {arch!r} is already an ls_ architecture; --to fairseq "
                         "converts the other way")
    if PREFIX + arch not in ARCHITECTURES:
        raise ValueError(
            f"fairseq architecture {arch!r} has no ls_ twin; supported: "
            + ", ".join(sorted(a[len(PREFIX):] for a in ARCHITECTURES))
        )
    return PREFIX + arch


def plain_config(obj):
    """``obj`` with every ``argparse.Namespace`` and omegaconf container turned into plain dicts
    and lists (types torch's ``weights_only`` loader accepts)."""
    if isinstance(obj, argparse.Namespace):
        return {k: plain_config(v) for k, v in vars(obj).items()}
    if isinstance(obj, dict):
        return {k: plain_config(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(plain_config(v) for v in obj)
    try:
        from omegaconf import OmegaConf
    except ImportError:  # pragma: no cover - a fairseq dependency
        return obj
    if OmegaConf.is_config(obj):
        return plain_config(OmegaConf.to_container(obj, resolve=True, enum_to_str=True))
    return obj


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
    if cfg is not None:
        # loadable with weights_only=True without allow-listing Namespace/DictConfig (legacy
        # ``args`` stays a Namespace: fairseq reads it as one)
        state["cfg"] = plain_config(cfg)
    return new_arch


def weights_only_blockers(obj, found=None):
    """Names of the types in ``obj`` that torch's ``weights_only`` loader refuses by default
    (conservative: anything but plain containers, numbers, strings and tensors)."""
    import collections

    import torch

    found = set() if found is None else found
    if isinstance(obj, (torch.Tensor, torch.Size, torch.dtype, torch.device)) or obj is None:
        return found
    if type(obj) in (str, bytes, int, float, bool, complex):
        return found
    if type(obj) in (dict, collections.OrderedDict, collections.Counter):
        for k, v in obj.items():
            weights_only_blockers(k, found)
            weights_only_blockers(v, found)
        return found
    if type(obj) in (list, tuple, set):
        for v in obj:
            weights_only_blockers(v, found)
        return found
    found.add(f"{type(obj).__module__}.{type(obj).__qualname__}")
    return found


def check_paths(input_path: str, output_path: str) -> None:
    """The mistakes that need no torch: missing input, unreadable input, missing output folder."""
    if not os.path.exists(input_path):
        raise ConvertError(f"input {input_path} does not exist")
    if os.path.isdir(input_path):
        raise ConvertError(f"input {input_path} is a folder, not a checkpoint file")
    if not os.access(input_path, os.R_OK):
        raise ConvertError(f"cannot read input {input_path}: permission denied")
    if os.path.isdir(output_path):
        raise ConvertError(f"output {output_path} is a folder: give the file name to write")
    folder = os.path.dirname(os.path.abspath(output_path))
    if not os.path.isdir(folder):
        raise ConvertError(f"output folder {folder} does not exist: create it first")
    if not os.access(folder, os.W_OK):
        raise ConvertError(f"cannot write to output folder {folder}: permission denied")


def load_checkpoint(path: str) -> dict:
    """The checkpoint dict, or ConvertError saying why ``path`` is not a fairseq checkpoint."""
    import torch

    from ..checkpoint_compat import fairseq_checkpoint_globals

    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ConvertError(f"cannot read input {path}: {exc.strerror or exc}") from None
    if not magic.startswith((b"PK\x03\x04", b"\x80")):  # torch.save's zip, or a legacy pickle
        raise ConvertError(f"not a fairseq checkpoint: {path} (not a file written by torch.save)")
    try:
        with warnings.catch_warnings(), fairseq_checkpoint_globals():
            warnings.simplefilter("ignore")  # torch's unpickler warnings would bury the one line
            state = torch.load(path, map_location="cpu")
    except OSError as exc:
        raise ConvertError(f"cannot read input {path}: {exc.strerror or exc}") from None
    except Exception as exc:  # noqa: BLE001 - every unpickling failure means "not a checkpoint"
        text = str(exc)
        refused = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
        unpickler = re.search(r"WeightsUnpickler error: \s*(.+)", text)
        if refused:  # the safe loader refuses a type no fairseq translation checkpoint holds
            reason = f"it holds {refused.group(1)}, not a type of fairseq's checkpoints"
        elif unpickler:  # torch's own lines around it are about weights_only, not the file
            reason = f"torch.load failed: {unpickler.group(1).strip()[:160]}"
        else:
            reason = (f"torch.load failed: {type(exc).__name__}: "
                      f"{(text.strip().splitlines() or [''])[0][:160]}")
        raise ConvertError(f"not a fairseq checkpoint: {path} ({reason})") from None
    if not isinstance(state, dict):
        raise ConvertError(f"not a fairseq checkpoint: {path} holds a {type(state).__name__}, "
                           "not fairseq's dict of 'model', 'cfg', 'optimizer_history', ...")
    if "model" not in state or (state.get("cfg") is None and state.get("args") is None):
        keys = ", ".join(sorted(str(k) for k in state)[:8]) or "none"
        raise ConvertError(f"not a fairseq checkpoint: {path} has no 'model' and 'cfg' entries "
                           f"(its keys: {keys})")
    return state


def save_checkpoint(state: dict, path: str) -> None:
    """torch.save to a temporary name in the output folder, then rename: a failed write leaves
    nothing behind and never a half-written checkpoint under ``path``."""
    import torch

    folder, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.tmp")
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    except OSError as exc:
        raise ConvertError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def build_parser():
    parser = argparse.ArgumentParser(prog="ls-fairseq-convert",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("input", help="fairseq checkpoint (.pt)")
    parser.add_argument("output", help="where to write the converted checkpoint")
    parser.add_argument("--to", choices=["fairseq", "ls"], required=True,
                        help="fairseq: ls_X -> X; ls: X -> ls_X")
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)  # before any torch/fairseq import: --help is instant
    import ls_fairseq

    ls_fairseq.register()  # the ls_ architectures and checkpoint types (skipped at import here)

    def fail(message):
        parser.exit(2, f"{parser.prog}: error: {message}\n")

    try:
        check_paths(args.input, args.output)
        state = load_checkpoint(args.input)
        try:
            new_arch = convert_state(state, args.to)
        except ValueError as exc:
            raise ConvertError(f"{args.input}: {exc}") from None
        blockers = weights_only_blockers(state) if args.to == "fairseq" else set()
        save_checkpoint(state, args.output)
    except ConvertError as exc:
        fail(str(exc))
    print(f"wrote {args.output} with arch {new_arch}")
    if blockers:
        print(f"note: it holds {', '.join(sorted(blockers))}: plain fairseq under torch >= 2.6 "
              "needs TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 to load it (docs/TROUBLESHOOTING.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
