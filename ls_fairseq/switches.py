"""The plugin's on/off switches for mechanisms that are on by default where they apply.

Each mechanism has two flags: ``--ls-X`` asks for it (the run is refused, with the reason, where it
cannot apply) and ``--ls-no-X`` turns it off. With neither it is on wherever it applies and steps
aside by itself elsewhere, with one log line saying why and how to get it.
"""
import logging

import torch.distributed as dist

AUTO, ON, OFF = "auto", "on", "off"


def resolve(on: bool, off: bool, flag: str) -> str:
    """``ON``, ``OFF`` or ``AUTO`` from the two flags of ``flag`` (e.g. ``--ls-cuda-graphs``)."""
    if on and off:
        no_flag = flag.replace("--ls-", "--ls-no-", 1)
        raise ValueError(f"{flag} and {no_flag} contradict each other: pass one of them")
    return ON if on else OFF if off else AUTO


def refuse_or_step_aside(mode: str, flag: str, reason: str, logger: logging.Logger) -> None:
    """Where ``flag``'s mechanism cannot apply because of ``reason``: raise if the user asked for
    it (``ON``), otherwise log one line (the caller then runs without it)."""
    if mode == ON:
        raise ValueError(f"{flag}: {reason}")
    if mode == AUTO:
        logger.info(f"{flag[2:]} is off for this run: {reason}")


def data_parallel_switch(trainer, attr: str, flag: str, logger: logging.Logger) -> bool:
    """Whether the criterion's switch ``attr`` (the mode of ``flag``) is on for ``trainer``'s
    run of several processes of plain data parallelism. One process, or a criterion without the
    switch: False. Fewer data-parallel workers than processes (model parallelism): refused if
    required, else the switch goes off for the run, said once."""
    criterion = getattr(trainer, "_criterion", None)
    mode = getattr(criterion, attr, OFF)
    if mode == OFF:
        return False
    workers = trainer.data_parallel_world_size
    processes = dist.get_world_size() if dist.is_available() and dist.is_initialized() \
        else workers
    if processes <= 1:
        return False
    if workers != processes:
        refuse_or_step_aside(
            mode, flag, f"it needs plain data parallelism (the data-parallel group is every "
            f"worker); this run has {workers} data-parallel workers of {processes} (model "
            f"parallelism)", logger)
        setattr(criterion, attr, OFF)  # stepped aside for the run
        return False
    return True
