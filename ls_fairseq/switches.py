"""The plugin's on/off switches for mechanisms that are on by default where they apply, and the
error class of every flag the plugin refuses.

Each mechanism has two flags: ``--ls-X`` asks for it (the run is refused, with the reason, where it
cannot apply) and ``--ls-no-X`` turns it off. With neither it is on wherever it applies and steps
aside by itself elsewhere, with one log line saying why and how to get it.

A refusal is a :class:`Refused`: fairseq-train reports it as one line on stderr and exits with
status 2, as for a usage error, without a traceback (``fairseq_patches``, patch 10). Runs are
checked when fairseq's trainer is built, before any data is loaded for training
(``fairseq_patches``, patch 9), from the facts in :class:`RunFacts`. The modes of one run, and
what it decides later (a mechanism that steps aside for it), are kept in
:class:`ls_fairseq.training_config.TrainingConfig`.
"""
import logging
from dataclasses import dataclass

AUTO, ON, OFF = "auto", "on", "off"


class Refused(ValueError):
    """A flag, or a combination of flags, that this run cannot honour. Its message is one line
    that names the flag, why, and what to change."""


@dataclass(frozen=True)
class RunFacts:
    """What a training run is, as the checks before it starts see it (``fairseq_patches``)."""
    cuda: bool  # the model trains on a CUDA device
    workers: int  # data-parallel workers
    processes: int  # processes of the run (more than workers under model parallelism)
    backend: str = "nccl"  # the distributed backend (--distributed-backend)


def resolve(on: bool, off: bool, flag: str) -> str:
    """``ON``, ``OFF`` or ``AUTO`` from the two flags of ``flag`` (e.g. ``--ls-cuda-graphs``)."""
    if on and off:
        no_flag = flag.replace("--ls-", "--ls-no-", 1)
        raise Refused(f"{flag} and {no_flag} contradict each other: pass one of them")
    return ON if on else OFF if off else AUTO


def refusal(flag: str, reason: str) -> Refused:
    """The error for ``flag``, asked for, where it cannot apply because of ``reason``."""
    return Refused(f"{flag}: {reason}; drop {flag} to train without it")


def refuse_or_step_aside(mode: str, flag: str, reason: str, logger: logging.Logger) -> None:
    """Where ``flag``'s mechanism cannot apply because of ``reason``: raise if the user asked for
    it (``ON``), otherwise log one line (the caller then runs without it)."""
    if mode == ON:
        raise refusal(flag, reason)
    if mode == AUTO:
        logger.info(step_aside_line(flag, reason))


def step_aside_line(flag: str, reason: str) -> str:
    """The one log line of a mechanism that steps aside by itself (docs/FLAGS.md)."""
    return f"{flag[2:]} is off for this run: {reason}"


def data_parallel_conflict(workers: int, processes: int):
    """Why a mechanism of several data-parallel workers cannot apply (None: it can), or ``""``
    for a run of one process, where it has nothing to do (off by default, refused if asked)."""
    if processes <= 1:
        return ""
    if workers != processes:
        return (f"it needs plain data parallelism (the data-parallel group is every worker); "
                f"this run has {workers} data-parallel workers of {processes} (model "
                f"parallelism)")
    return None


ONE_PROCESS = "it works between several workers (GPUs), and this run has one"


def at_least(flag: str, value, least, meaning: str = "") -> None:
    """Refuse ``flag``'s ``value`` below ``least``, or NaN (``meaning``: what its smallest values
    do)."""
    if not value >= least:  # NaN too
        said = f" ({meaning})" if meaning else ""
        raise Refused(f"{flag} must be >= {least}{said}, got {value}")
