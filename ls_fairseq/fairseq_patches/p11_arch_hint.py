"""fairseq_patches, patch 11: ``options.add_model_args`` (architecture typos).

fairseq-train's parser answers an unknown ``--arch`` with its usage and one line listing every
architecture (~3,800 characters). After fairseq's message the parser then prints one more line
with the nearest names (``difflib``) and the ls_ architectures. Every other parser error:
argparse's, unchanged. The hint is set on each parser built while the patch is installed
(``parser.error``); uninstalling leaves those parsers as they are.
"""
import difflib
import functools
import re
import sys

NUMBER = 11

_BAD_ARCH = re.compile(r"^argument --arch(?:/-a)?: invalid choice: '([^']*)'")


def arch_hint(message: str):
    """The line printed after fairseq's error for an unknown ``--arch`` (None for any other
    error): the nearest registered names, and the ls_ architectures."""
    from fairseq.models import ARCH_MODEL_REGISTRY

    from ..models.ls_transformer import ARCHITECTURES

    found = _BAD_ARCH.match(message)
    if not found:
        return None
    given = found.group(1)
    # an ls_ name with a typo: the nearest ls_ names; anything else: the nearest of all
    names = list(ARCHITECTURES) if given.startswith("ls") else list(ARCH_MODEL_REGISTRY)
    near = difflib.get_close_matches(given, names, n=3, cutoff=0.6)
    nearest = f"; the nearest: {', '.join(near)}" if near else ""
    return (f"ls_fairseq: --arch {given!r} is not an architecture{nearest} (the ls_ "
            f"architectures: {', '.join(ARCHITECTURES)})")


def _with_arch_hint(parser):
    """``parser.error`` also prints :func:`arch_hint`'s line, after argparse's message."""
    if getattr(parser, "_ls_arch_hint", False):
        return
    parser._ls_arch_hint = True
    error = parser.error

    def error_with_hint(message):
        hint = arch_hint(message)
        try:
            error(message)
        finally:
            if hint is not None:
                sys.stderr.write(hint + "\n")

    parser.error = error_with_hint


def targets():
    from fairseq import options

    def make(original):
        @functools.wraps(original)
        def add_model_args(parser):
            group = original(parser)
            _with_arch_hint(parser)
            return group
        return add_model_args

    return [(options, "add_model_args", make)]
