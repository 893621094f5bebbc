"""The ``--ls-*`` switches of one training run, read once: :class:`TrainingConfig`.

fairseq keeps the flags of ``--criterion ls_label_smoothed_cross_entropy`` in ``cfg.criterion``
and those of ``--optimizer ls_adam`` in ``cfg.optimizer``. :meth:`TrainingConfig.from_cfg` reads
both into one frozen object: each on/off switch resolved to ``ON``/``OFF``/``AUTO``
(``switches.resolve``, which refuses ``--ls-X`` with ``--ls-no-X``), each value checked with the
criterion's own refusals. fairseq-train builds it once per trainer, after fairseq's
``Trainer.__init__`` (``fairseq_patches``, patch 9), and keeps it on the trainer
(:func:`attach`, :func:`of`); the fairseq patches read the switches there, not through the
criterion or the optimizer.

What the run decides later lives on the same object, in its one mutable part,
:class:`RunDecisions`: a default mechanism that steps aside for the run (one log line; e.g.
batches fixed to GPUs under model parallelism or with a prefetching dataset) and whether an update
leaves its GPU work queued without a host read (ls_adam's deferred overflow check, recorded when
fairseq builds the optimizer: patch 1). A trainer without a config (built while the patches were
uninstalled, or another trainer) has every switch off: fairseq's own behaviour.

The criterion and ls_adam still read their own options for their own mechanisms (they own them);
docs/FLAGS.md lists the flags.
"""
import logging
from dataclasses import dataclass, field, fields
from typing import Dict, Optional

import torch.distributed as dist

from . import switches
from .switches import AUTO, OFF, ON  # noqa: F401  (the modes of every switch)

#: the one attribute of a trainer that holds its config (:func:`attach`, :func:`of`)
ATTRIBUTE = "_ls_training_config"
#: the modes of the ``--ls-cuda-graphs-capture`` and ``--ls-cuda-graphs-memory`` defaults
CAPTURE_DEFAULT, MEMORY_DEFAULT = "auto", "compact"
#: two of the criterion's refusals (criterion_switches, which the criterion calls too)
CHUNK_ZERO = "0: about 256 MiB of logits per chunk"
COPY_ENGINE_WITHOUT_GRAPHS = ("--ls-copy-engine-all-reduce: it is part of the CUDA-graph engine; "
                              "drop --ls-no-cuda-graphs")


@dataclass
class RunDecisions:
    """What one run decided after its flags were read (the mutable part of a config)."""
    #: switch (a :class:`TrainingConfig` field) -> why it stepped aside for this run
    stepped_aside: Dict[str, str] = field(default_factory=dict)
    #: an update leaves its GPU work queued without reading anything back (ls_adam's fused fp16
    #: copy with its deferred overflow check), recorded when fairseq builds the optimizer
    host_reads_deferred: bool = False


@dataclass(frozen=True)
class TrainingConfig:
    """The resolved ``--ls-*`` switches of one run. A switch pair ``--ls-X``/``--ls-no-X`` is
    the field ``ls_X``: ``ON`` (required), ``OFF`` (turned off, or not a flag of this run's
    criterion/optimizer) or ``AUTO`` (on where it applies); the other fields are the values as
    given. ``TrainingConfig()`` is a run of neither the criterion nor ls_adam."""
    # --criterion ls_label_smoothed_cross_entropy
    ls_criterion: bool = False  # the run's criterion is ls_label_smoothed_cross_entropy
    ls_fused_output_ce: bool = False
    ls_fused_output_ce_chunk: int = 0
    ls_cuda_graphs: str = OFF
    ls_cuda_graphs_capture: str = CAPTURE_DEFAULT
    ls_cuda_graphs_memory: str = MEMORY_DEFAULT
    ls_cuda_graphs_max: int = 256
    ls_shape_buckets: int = 16
    ls_shape_bucket_slack: float = 0.2
    ls_all_reduce_bucket_mb: float = 25.0
    ls_copy_engine_all_reduce: str = OFF
    ls_async_stats: str = OFF
    ls_fix_batches_to_gpus: str = OFF
    ls_cost_matching_window: int = 0
    # --optimizer ls_adam
    ls_adam: bool = False  # the run's optimizer is ls_adam
    ls_fused_fp16_copy: str = OFF
    ls_deferred_overflow_check: str = OFF
    ls_sharded_optimizer_step: str = OFF
    #: what the run decided since (the one mutable part; not compared)
    run: RunDecisions = field(default_factory=RunDecisions, compare=False, repr=False)

    @classmethod
    def from_cfg(cls, cfg) -> "TrainingConfig":
        """The config of fairseq's ``cfg`` (its ``criterion`` and ``optimizer`` namespaces);
        raises :class:`switches.Refused` with the criterion's and the optimizer's own lines."""
        return cls(**criterion_switches(getattr(cfg, "criterion", None)),
                   **optimizer_switches(getattr(cfg, "optimizer", None)))

    def mode(self, switch: str) -> str:
        """The mode of ``switch`` (a field, e.g. ``"ls_async_stats"``) for this run: ``OFF``
        once it stepped aside."""
        return OFF if switch in self.run.stepped_aside else getattr(self, switch)

    def step_aside(self, switch: str, reason: str) -> None:
        """Record that ``switch`` is off for the rest of the run, because of ``reason`` (the
        caller has said so, or refused the run, with ``switches.refuse_or_step_aside``)."""
        self.run.stepped_aside.setdefault(switch, reason)

    def decline(self, switch: str, flag: str, reason: str, logger: logging.Logger) -> None:
        """``switch`` (the mode of ``flag``) cannot apply to this run, because of ``reason``:
        refused if required, else off for the rest of the run, said once."""
        switches.refuse_or_step_aside(self.mode(switch), flag, reason, logger)
        self.step_aside(switch, reason)


def criterion_switches(c, check_graphs=None) -> dict:
    """The :class:`TrainingConfig` fields of ``--criterion ls_label_smoothed_cross_entropy``'s
    options ``c`` (``cfg.criterion``, or the criterion's own arguments; empty for another
    criterion), with its refusals. The criterion resolves its flags here too: ``check_graphs``
    (its shape buckets, graphs' own rule) runs where graphs are on, between the graphs' and the
    copy engine's switches."""
    if not hasattr(c, "ls_no_cuda_graphs"):
        return {}
    chunk = c.ls_fused_output_ce_chunk
    switches.at_least("--ls-fused-output-ce-chunk", chunk, 0, CHUNK_ZERO)
    graphs = switches.resolve(c.ls_cuda_graphs, c.ls_no_cuda_graphs, "--ls-cuda-graphs")
    if graphs != OFF:
        switches.at_least("--ls-cuda-graphs-max", c.ls_cuda_graphs_max, 1)
        if check_graphs is not None:
            check_graphs()
    copy_engine = switches.resolve(c.ls_copy_engine_all_reduce, c.ls_no_copy_engine_all_reduce,
                                   "--ls-copy-engine-all-reduce")
    if copy_engine == ON and graphs == OFF:
        raise switches.Refused(COPY_ENGINE_WITHOUT_GRAPHS)
    async_stats = switches.resolve(c.ls_async_stats, c.ls_no_async_stats, "--ls-async-stats")
    fixed = switches.resolve(c.ls_fix_batches_to_gpus, c.ls_no_fix_batches_to_gpus,
                             "--ls-fix-batches-to-gpus")
    switches.at_least("--ls-cost-matching-window", c.ls_cost_matching_window, 0, "0: off")
    return dict(
        ls_criterion=True, ls_fused_output_ce=bool(c.ls_fused_output_ce),
        ls_fused_output_ce_chunk=int(chunk), ls_cuda_graphs=graphs,
        ls_cuda_graphs_capture=str(c.ls_cuda_graphs_capture),
        ls_cuda_graphs_memory=str(c.ls_cuda_graphs_memory),
        ls_cuda_graphs_max=int(c.ls_cuda_graphs_max), ls_shape_buckets=int(c.ls_shape_buckets),
        ls_shape_bucket_slack=float(c.ls_shape_bucket_slack),
        ls_all_reduce_bucket_mb=float(c.ls_all_reduce_bucket_mb),
        ls_copy_engine_all_reduce=copy_engine, ls_async_stats=async_stats,
        ls_fix_batches_to_gpus=fixed, ls_cost_matching_window=int(c.ls_cost_matching_window))


def optimizer_switches(o) -> dict:
    """The :class:`TrainingConfig` fields of ``--optimizer ls_adam``'s options ``o``
    (``cfg.optimizer``; empty for another optimizer). Contradicting pairs are refused here; what
    each mechanism needs of the rest of the run, ls_adam refuses where it decides it."""
    if getattr(o, "_name", None) != "ls_adam":
        return {}

    def mode(name, flag):
        return switches.resolve(getattr(o, f"ls_{name}", False),
                                getattr(o, f"ls_no_{name}", False), flag)

    return dict(ls_adam=True,
                ls_fused_fp16_copy=mode("fused_fp16_copy", "--ls-fused-fp16-copy"),
                ls_deferred_overflow_check=mode("deferred_overflow_check",
                                                "--ls-deferred-overflow-check"),
                ls_sharded_optimizer_step=mode("sharded_optimizer_step",
                                               "--ls-sharded-optimizer-step"))


#: every field that is a switch pair's mode (``ON``/``OFF``/``AUTO``)
SWITCHES = tuple(f.name for f in fields(TrainingConfig)
                 if f.type is str and f.default == OFF)


def attach(trainer, config: TrainingConfig) -> TrainingConfig:
    """Keep ``config`` as ``trainer``'s (``fairseq_patches``, patch 9, once per trainer)."""
    setattr(trainer, ATTRIBUTE, config)
    return config


def of(trainer) -> Optional[TrainingConfig]:
    """``trainer``'s config, or None (a trainer built without the patches)."""
    return getattr(trainer, ATTRIBUTE, None)


def workers_and_processes(trainer):
    """``trainer``'s data-parallel workers and the processes of its run (more than the workers
    under model parallelism)."""
    workers = trainer.data_parallel_world_size
    processes = dist.get_world_size() if dist.is_available() and dist.is_initialized() \
        else workers
    return workers, processes


def data_parallel_switch(trainer, switch: str, flag: str, logger: logging.Logger) -> bool:
    """Whether ``switch`` (the mode of ``flag``, e.g. ``"ls_async_stats"``) is on for
    ``trainer``'s run of several processes of plain data parallelism. One process, or a trainer
    whose config has it off (or no config): False. Fewer data-parallel workers than processes
    (model parallelism): refused if required, else the switch steps aside for the run, said
    once."""
    config = of(trainer)
    mode = config.mode(switch) if config is not None else OFF
    if mode == OFF:
        return False
    reason = switches.data_parallel_conflict(*workers_and_processes(trainer))
    if reason == "":
        return False
    if reason is not None:
        config.decline(switch, flag, reason, logger)
        return False
    return True
