"""The run's ``--ls-*`` switches read once (ls_fairseq/training_config.py).

The config is built from fairseq-train command lines parsed by fairseq's own option parser with
the plugin's ``--user-dir`` (and once through fairseq's own ``convert_namespace_to_omegaconf``,
the cfg a trainer holds): every switch of the criterion and of ls_adam in its three modes (neither
flag: ``auto``; ``--ls-X``: ``on``; ``--ls-no-X``: ``off``), each contradiction and bad value
refused with the line the criterion or ls_adam gives for it, another criterion's or optimizer's
run with every switch off. A default that steps aside for the run is recorded on the config, not
on the criterion. A grep keeps the fairseq patches and ``switches`` off the criterion's and the
optimizer's switch attributes.
"""
import ast
import dataclasses
import os
import re

import pytest
from fairseq import options
from fairseq.criterions import CRITERION_REGISTRY

import ls_fairseq
from fairseq_helpers import DummyTask, make_dictionary
from ls_fairseq import switches, training_config
from ls_fairseq.training_config import TrainingConfig

USER_DIR = os.path.dirname(ls_fairseq.__file__)
CRITERION, OPTIMIZER = "ls_label_smoothed_cross_entropy", "ls_adam"

#: field -> flag of every switch pair
CRITERION_SWITCHES = {"ls_cuda_graphs": "--ls-cuda-graphs",
                      "ls_copy_engine_all_reduce": "--ls-copy-engine-all-reduce",
                      "ls_async_stats": "--ls-async-stats",
                      "ls_fix_batches_to_gpus": "--ls-fix-batches-to-gpus"}
OPTIMIZER_SWITCHES = {"ls_fused_fp16_copy": "--ls-fused-fp16-copy",
                      "ls_deferred_overflow_check": "--ls-deferred-overflow-check",
                      "ls_sharded_optimizer_step": "--ls-sharded-optimizer-step"}


def _args(*flags, criterion=CRITERION, optimizer=OPTIMIZER):
    return options.parse_args_and_arch(options.get_training_parser(), [
        "/nonexistent", "--user-dir", USER_DIR, "--arch", "ls_transformer", "--task",
        "translation", "--criterion", criterion, "--optimizer", optimizer, "--lr", "1e-3",
        *flags])


def _cfg(*flags, **kw):
    """fairseq's config of the command line (``convert_namespace_to_omegaconf`` in a cheaper
    form: the criterion's and the optimizer's groups, from their registered dataclasses)."""
    from test_fast_defaults import parsed_config

    args = _args(*flags, **kw)  # the plugin's --user-dir, as fairseq-train reads it
    return args, parsed_config(*flags, **kw)[1]


def test_every_switch_pair_is_a_field():
    """Each --ls-X/--ls-no-X pair of the criterion and of ls_adam is one mode field, and the
    config's switches are exactly those pairs."""
    args = _args()
    pairs = {k for k in vars(args) if k.startswith("ls_no_")}
    assert {"ls_" + k[len("ls_no_"):] for k in pairs} >= set(CRITERION_SWITCHES) | \
        set(OPTIMIZER_SWITCHES)
    assert set(training_config.SWITCHES) == set(CRITERION_SWITCHES) | set(OPTIMIZER_SWITCHES)


def test_from_fairseqs_own_cfg():
    """The trainer's cfg (an omegaconf DictConfig, as fairseq-train builds it) gives the same
    config as the parsed flags."""
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    flags = ("--ls-no-async-stats", "--ls-cost-matching-window", "8", "--ls-shape-buckets", "4",
             "--ls-fused-fp16-copy")
    args, cfg = _cfg(*flags)
    config = TrainingConfig.from_cfg(convert_namespace_to_omegaconf(args))
    assert config == TrainingConfig.from_cfg(cfg)
    assert config.ls_async_stats == switches.OFF and config.ls_cost_matching_window == 8
    assert config.ls_shape_buckets == 4 and config.ls_fused_fp16_copy == switches.ON
    assert config.ls_criterion and config.ls_adam


def test_defaults():
    """Neither flag of any pair: every switch auto; the values are the options' defaults."""
    _, cfg = _cfg()
    config = TrainingConfig.from_cfg(cfg)
    for name in training_config.SWITCHES:
        assert getattr(config, name) == switches.AUTO, name
    c = cfg.criterion
    for name in ("ls_cuda_graphs_capture", "ls_cuda_graphs_memory", "ls_cuda_graphs_max",
                 "ls_shape_buckets", "ls_shape_bucket_slack", "ls_all_reduce_bucket_mb",
                 "ls_cost_matching_window", "ls_fused_output_ce", "ls_fused_output_ce_chunk"):
        assert getattr(config, name) == getattr(c, name), name
    assert config.run == training_config.RunDecisions()


@pytest.mark.parametrize("field,flag", sorted({**CRITERION_SWITCHES, **OPTIMIZER_SWITCHES}.items()))
def test_each_switch_in_its_three_modes(field, flag):
    no_flag = flag.replace("--ls-", "--ls-no-", 1)
    for flags, mode in (((), switches.AUTO), ((flag,), switches.ON), ((no_flag,), switches.OFF)):
        config = TrainingConfig.from_cfg(_cfg(*flags)[1])
        assert getattr(config, field) == mode, (flags, field)
        assert config.mode(field) == mode
        others = [n for n in training_config.SWITCHES if n != field]
        assert all(getattr(config, n) == switches.AUTO for n in others), flags


@pytest.mark.parametrize("flag", sorted({**CRITERION_SWITCHES, **OPTIMIZER_SWITCHES}.values()))
def test_a_contradiction_is_refused_with_the_line_of_the_flags_owner(flag):
    no_flag = flag.replace("--ls-", "--ls-no-", 1)
    _, cfg = _cfg(flag, no_flag)
    with pytest.raises(switches.Refused) as ours:
        TrainingConfig.from_cfg(cfg)
    assert str(ours.value) == f"{flag} and {no_flag} contradict each other: pass one of them"
    with pytest.raises(switches.Refused) as theirs:  # the criterion's, or ls_adam's
        _build_owner(cfg, flag in OPTIMIZER_SWITCHES.values())
    assert str(theirs.value) == str(ours.value)


def _build_owner(cfg, optimizer):
    """Build the criterion, or ls_adam, of ``cfg`` as fairseq does."""
    import torch
    from fairseq.optim import OPTIMIZER_REGISTRY

    if optimizer:
        return OPTIMIZER_REGISTRY[OPTIMIZER](cfg.optimizer, [torch.nn.Parameter(torch.zeros(2))])
    return CRITERION_REGISTRY[CRITERION].build_criterion(cfg.criterion,
                                                         DummyTask(make_dictionary()))


@pytest.mark.parametrize("flags,line", [
    (("--ls-cuda-graphs-max", "0"), "--ls-cuda-graphs-max must be >= 1, got 0"),
    (("--ls-fused-output-ce-chunk", "-1"), "--ls-fused-output-ce-chunk must be >= 0 (0: about "
                                           "256 MiB of logits per chunk), got -1"),
    (("--ls-cost-matching-window", "-4"), "--ls-cost-matching-window must be >= 0 (0: off), "
                                          "got -4"),
    (("--ls-no-cuda-graphs", "--ls-copy-engine-all-reduce"),
     "--ls-copy-engine-all-reduce: it is part of the CUDA-graph engine; drop --ls-no-cuda-graphs"),
])
def test_bad_values_are_refused_with_the_criterions_line(flags, line):
    _, cfg = _cfg(*flags)
    with pytest.raises(switches.Refused) as ours:
        TrainingConfig.from_cfg(cfg)
    with pytest.raises(switches.Refused) as theirs:
        _build_owner(cfg, optimizer=False)
    assert str(ours.value) == str(theirs.value) == line


def test_another_criterion_and_optimizer_have_every_switch_off():
    _, cfg = _cfg(criterion="label_smoothed_cross_entropy", optimizer="adam")
    config = TrainingConfig.from_cfg(cfg)
    assert config == TrainingConfig() and not config.ls_criterion and not config.ls_adam
    assert all(getattr(config, n) == switches.OFF for n in training_config.SWITCHES)
    ls_crit = TrainingConfig.from_cfg(_cfg(optimizer="adam")[1])
    assert ls_crit.ls_async_stats == switches.AUTO and ls_crit.ls_fused_fp16_copy == switches.OFF


def test_the_config_is_frozen_and_its_decisions_are_its_own():
    config = TrainingConfig.from_cfg(_cfg()[1])
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.ls_async_stats = switches.OFF
    other = TrainingConfig.from_cfg(_cfg()[1])
    config.step_aside("ls_async_stats", "why")
    assert other.mode("ls_async_stats") == switches.AUTO  # one RunDecisions per config
    assert config.mode("ls_async_stats") == switches.OFF and config.ls_async_stats == "auto"


def test_attached_once_per_trainer():
    from types import SimpleNamespace

    trainer = SimpleNamespace()
    assert training_config.of(trainer) is None
    config = training_config.attach(trainer, TrainingConfig())
    assert training_config.of(trainer) is config
    assert list(vars(trainer)) == [training_config.ATTRIBUTE]


def test_stepped_aside_is_recorded_on_the_config_not_on_the_criterion(monkeypatch, caplog):
    """Under model parallelism (fewer data-parallel workers than processes) a default
    data-parallel switch steps aside for the run: one line, the mode off from then on, the
    reason on the config's RunDecisions, the criterion untouched; required, it is refused."""
    import logging
    from types import SimpleNamespace

    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    criterion = SimpleNamespace()
    trainer = SimpleNamespace(_criterion=criterion, data_parallel_world_size=2)
    config = training_config.attach(trainer, TrainingConfig.from_cfg(_cfg()[1]))
    logger = logging.getLogger("test_training_config")
    with caplog.at_level("INFO", logger="test_training_config"):
        for _ in range(2):
            assert not training_config.data_parallel_switch(
                trainer, "ls_fix_batches_to_gpus", "--ls-fix-batches-to-gpus", logger)
    assert [r.getMessage() for r in caplog.records] == [
        "ls-fix-batches-to-gpus is off for this run: it needs plain data parallelism (the "
        "data-parallel group is every worker); this run has 2 data-parallel workers of 4 (model "
        "parallelism)"]
    assert config.mode("ls_fix_batches_to_gpus") == switches.OFF
    assert config.ls_fix_batches_to_gpus == switches.AUTO  # the flags' mode is kept
    assert "model parallelism" in config.run.stepped_aside["ls_fix_batches_to_gpus"]
    assert vars(criterion) == {}
    required = SimpleNamespace(data_parallel_world_size=2)
    training_config.attach(required, TrainingConfig.from_cfg(_cfg("--ls-async-stats")[1]))
    with pytest.raises(switches.Refused, match="^--ls-async-stats: it needs plain data "
                                               "parallelism"):
        training_config.data_parallel_switch(required, "ls_async_stats", "--ls-async-stats",
                                             logger)
    # plain data parallelism: on; one process, or a trainer without a config: off
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    assert training_config.data_parallel_switch(trainer, "ls_async_stats", "--ls-async-stats",
                                                logger)
    assert not training_config.data_parallel_switch(SimpleNamespace(data_parallel_world_size=2),
                                                    "ls_async_stats", "--ls-async-stats", logger)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    trainer.data_parallel_world_size = 1
    assert not training_config.data_parallel_switch(trainer, "ls_async_stats",
                                                    "--ls-async-stats", logger)


# ---- nobody reads the criterion's or the optimizer's switches through the trainer -----------

def _sources():
    root = os.path.join(USER_DIR, "fairseq_patches")
    paths = [os.path.join(root, n) for n in sorted(os.listdir(root)) if n.endswith(".py")]
    return paths + [os.path.join(USER_DIR, "switches.py")]


def test_patches_and_switches_read_no_switch_of_the_criterion_or_the_optimizer():
    """fairseq_patches/ and switches.py: no ``_criterion.ls_*`` read, no ``defers_host_reads``
    attribute, no ``getattr(<criterion>, ...)``, and no attribute assigned on a criterion (their
    switches come from the run's TrainingConfig)."""
    assert len(_sources()) > 10
    bad = []
    for path in _sources():
        with open(path) as f:
            text = f.read()
        name = os.path.relpath(path, USER_DIR)
        for pattern in (r"_criterion\.ls_", r"\.defers_host_reads\b", r"\bdefers_host_reads\b"):
            bad += [f"{name}: {m.group(0)}" for m in re.finditer(pattern, text)]
        for node in ast.walk(ast.parse(text)):
            targets = []
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Attribute) and "criterion" in ast.unparse(sub.value):
                        bad.append(f"{name}:{node.lineno}: assigns {ast.unparse(sub)}")
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("setattr", "getattr") \
                    and node.args and "criterion" in ast.unparse(node.args[0]):
                bad.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert bad == []


def test_the_grep_sees_what_it_forbids(tmp_path):
    """The checks above on the code they forbid (the old patch 7 and data_parallel_switch)."""
    code = ("window = getattr(getattr(self, '_criterion', None), 'ls_cost_matching_window', 0)\n"
            "criterion.ls_fix_batches_to_gpus, fixed = OFF, False\n"
            "setattr(criterion, attr, OFF)\n"
            "waits = not trainer._optimizer.defers_host_reads\n"
            "x = trainer._criterion.ls_async_stats\n")
    tree = ast.parse(code)
    assigned = [ast.unparse(sub) for node in ast.walk(tree) if isinstance(node, ast.Assign)
                for t in node.targets for sub in ast.walk(t)
                if isinstance(sub, ast.Attribute) and "criterion" in ast.unparse(sub.value)]
    calls = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Call)
             and ast.unparse(n.func) in ("setattr", "getattr") and n.args
             and "criterion" in ast.unparse(n.args[0])]
    assert assigned == ["criterion.ls_fix_batches_to_gpus"]
    assert len(calls) == 2
    assert re.search(r"_criterion\.ls_", code) and re.search(r"\bdefers_host_reads\b", code)
