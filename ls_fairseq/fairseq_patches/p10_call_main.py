"""fairseq_patches, patch 10: ``distributed_utils.call_main`` (one line, not a traceback).

fairseq-train reports a :class:`ls_fairseq.switches.Refused` (a bad ``--ls-*`` value, a flag
that cannot apply, a checkpoint to convert first) as one line on stderr, ``ls_fairseq:
<message>``, and exits with status 2, as argparse does for a usage error; raised in a worker
process that ``torch.multiprocessing.spawn`` started, it reaches this process as that process's
traceback, and the same line is printed from it. Every other error: fairseq's, unchanged.
"""
import functools
import re
import sys

import torch

from .. import switches

NUMBER = 10

_REFUSED_IN_TRACEBACK = re.compile(r"^ls_fairseq\.switches\.Refused: (.+)$", re.M)


def refusal_line(message: str) -> str:
    """The line fairseq-train prints for a refusal."""
    return message if message.startswith("ls_fairseq: ") else f"ls_fairseq: {message}"


def exit_refused(message: str):
    sys.stdout.flush()
    sys.stderr.write(refusal_line(message) + "\n")
    sys.stderr.flush()
    raise SystemExit(2)


def refusal_of_worker(exc):
    """The refusal a spawned worker raised, from the traceback it sent (None: another error)."""
    found = _REFUSED_IN_TRACEBACK.findall(str(exc))
    return found[-1] if found else None


def targets():
    from fairseq.distributed import utils as distributed_utils

    def make(original):
        @functools.wraps(original)
        def call_main(cfg, main, **kwargs):
            try:
                return original(cfg, main, **kwargs)
            except switches.Refused as exc:
                exit_refused(str(exc))
            except torch.multiprocessing.ProcessRaisedException as exc:
                message = refusal_of_worker(exc)
                if message is None:
                    raise
                exit_refused(message)
        return call_main

    return [(distributed_utils, "call_main", make)]
