#!/usr/bin/env python3
"""Kernel and op micro-benchmarks on one GPU: ``python bench/kernels.py NAME [options]``.

Each sub-command prints a table (``NAME --help`` gives its options; its module in
bench/benchlib/kernels/ says at its top what it measures and how):

{commands}

Without a sub-command, the options go to ``elementwise`` (this script's table before the others
joined it). ``LS_FAIRSEQ_KERNELS=require`` makes a missing CUDA extension an error instead of a
fallback. Run from the repository root.
"""
import importlib
import sys

from benchlib.kernels import SUBCOMMANDS

__doc__ = __doc__.format(commands="\n".join(f"* ``{name}``: {text}"
                                            for name, text in SUBCOMMANDS.items()))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("-h", "--help"):
        print("usage: kernels.py [-h] {" + ",".join(SUBCOMMANDS) + "} [options]\n")
        print(__doc__)
        return 0
    name = "elementwise"
    if argv and not argv[0].startswith("-"):
        name = argv.pop(0)
        if name not in SUBCOMMANDS:
            sys.exit(f"kernels.py: unknown sub-command {name!r}; one of {', '.join(SUBCOMMANDS)}")
    return importlib.import_module(f"benchlib.kernels.{name}").main(argv)


if __name__ == "__main__":
    main()
