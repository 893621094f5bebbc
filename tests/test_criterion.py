"""ls_label_smoothed_cross_entropy vs fairseq's label_smoothed_cross_entropy (CPU).

Both criteria see the same model output; loss, nll_loss, sample_size, accuracy counts and every
parameter gradient must agree. Tolerance: relative 1e-6 on losses (fp32 sums of the same terms in
a different order) and the gradient rule of test_model_equivalence.
"""
import argparse
from types import SimpleNamespace

import pytest
import torch
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    label_smoothed_nll_loss,
)

from fairseq_helpers import (DummyTask, build_model, make_dictionary, max_rel_err, random_sample,
                             run_criterion)
from ls_fairseq.criterions.ls_label_smoothed_cross_entropy import (
    LSLabelSmoothedCrossEntropyCriterion,
)
from ls_fairseq.ops import label_smoothed_cross_entropy_reference

TINY = ["--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "16",
        "--encoder-ffn-embed-dim", "24", "--encoder-attention-heads", "2",
        "--decoder-attention-heads", "2", "--dropout", "0", "--share-all-embeddings"]


@pytest.fixture(scope="module")
def dictionary():
    return make_dictionary(51)


def _sample(dictionary, g):
    return random_sample(dictionary, 5, 7, 9, g)


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.37])
@pytest.mark.parametrize("ignore_prefix_size", [0, 2])
@pytest.mark.parametrize("sentence_avg", [False, True])
def test_matches_fairseq(dictionary, eps, ignore_prefix_size, sentence_avg):
    task = DummyTask(dictionary)
    kwargs = dict(sentence_avg=sentence_avg, label_smoothing=eps,
                  ignore_prefix_size=ignore_prefix_size, report_accuracy=True)
    ref_crit = LabelSmoothedCrossEntropyCriterion(task, **kwargs)
    ls_crit = LSLabelSmoothedCrossEntropyCriterion(task, **kwargs)
    g = torch.Generator().manual_seed(int(eps * 100) + ignore_prefix_size + 7 * sentence_avg)
    model = build_model("ls_transformer", dictionary, TINY, seed=3)
    sample = _sample(dictionary, g)

    ref_loss, ref_size, ref_log, ref_grads = run_criterion(ref_crit, model, sample)
    ls_loss, ls_size, ls_log, ls_grads = run_criterion(ls_crit, model, sample)

    assert ls_size == ref_size
    assert max_rel_err(ls_loss, ref_loss) <= 1e-6
    assert max_rel_err(ls_log["nll_loss"], ref_log["nll_loss"]) <= 1e-6
    for key in ("ntokens", "nsentences", "sample_size", "n_correct", "total"):
        assert ls_log[key] == ref_log[key], key
    for key, grad in ls_grads.items():
        assert max_rel_err(grad, ref_grads[key]) <= 1e-5, key


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("n,v", [(1, 2), (13, 7), (64, 301)])
def test_op_reference_matches_fairseq_formula(dtype, n, v):
    g = torch.Generator().manual_seed(n * v)
    logits = (torch.randn(n, v, generator=g) * 3).to(dtype)
    target = torch.randint(0, v, (n,), generator=g)
    target[0] = 1  # make sure some rows are padding (ignore_index=1)
    lprobs = torch.log_softmax(logits.double(), dim=-1)
    ref_loss, ref_nll = label_smoothed_nll_loss(lprobs, target, 0.1, ignore_index=1)
    loss, nll = label_smoothed_cross_entropy_reference(logits, target, 0.1, ignore_index=1)
    tol = 1e-5 if dtype != torch.float64 else 1e-12
    assert max_rel_err(loss, ref_loss) <= tol
    assert max_rel_err(nll, ref_nll) <= tol


def test_per_token_losses_use_fairseq_path(dictionary):
    task = DummyTask(dictionary)
    crit = LSLabelSmoothedCrossEntropyCriterion(task, False, 0.1, 0, False)
    model = build_model("ls_transformer", dictionary, TINY, seed=3)
    sample = _sample(dictionary, torch.Generator().manual_seed(0))
    out = model(**sample["net_input"])
    loss, _ = crit.compute_loss(model, out, sample, reduce=False)
    assert loss.numel() == sample["target"].numel()


def test_cuda_graphs_flag_runs_eagerly_without_cuda(dictionary, caplog):
    """--ls-cuda-graphs on CPU tensors: the documented fallback (one warning, eager steps with
    identical results). The replay itself is tested on the GPU (tests/gpu/test_cuda_graphs_cuda.py)."""
    task = DummyTask(dictionary)
    kwargs = dict(sentence_avg=False, label_smoothing=0.1, report_accuracy=True)
    plain = LSLabelSmoothedCrossEntropyCriterion(task, ls_no_cuda_graphs=True, **kwargs)
    graphed = LSLabelSmoothedCrossEntropyCriterion(task, ls_cuda_graphs=True, **kwargs)
    model = build_model("ls_transformer", dictionary, TINY, seed=3)
    sample = _sample(dictionary, torch.Generator().manual_seed(5))
    with caplog.at_level("WARNING"):
        results = [graphed(model, sample) for _ in range(3)]
    assert sum(r.message.startswith("--ls-cuda-graphs:") for r in caplog.records) == 1
    assert graphed.graphs.stats["captured"] == 0 and graphed.graphs.off_reason is None
    want_loss, want_size, want_log = plain(model, sample)
    for loss, size, log in results:
        assert torch.equal(loss, want_loss) and size == want_size
        assert log["n_correct"] == want_log["n_correct"]


def test_cuda_graphs_max_must_be_positive(dictionary):
    with pytest.raises(ValueError, match="--ls-cuda-graphs-max"):
        LSLabelSmoothedCrossEntropyCriterion(DummyTask(dictionary), sentence_avg=False,
                                             label_smoothing=0.1, ls_cuda_graphs=True,
                                             ls_cuda_graphs_max=0)


def test_cuda_graphs_aliases_match_the_parameters(dictionary):
    """The graphs run the model on aliases of its parameters (same storage, own autograd leaves;
    see CudaGraphedLoss._check_aliases). On CPU: same loss, the aliases receive exactly the
    gradients the parameters would, the parameters' .grad stays untouched, and replacing a
    parameter's storage makes new aliases."""
    task = DummyTask(dictionary)
    crit = LSLabelSmoothedCrossEntropyCriterion(task, sentence_avg=False, label_smoothing=0.1,
                                                ls_cuda_graphs=True)
    model = build_model("ls_transformer", dictionary, TINY + ["--dropout", "0"], seed=3)
    sample = _sample(dictionary, torch.Generator().manual_seed(7))
    runner = crit.graphs
    slots = [(n, id(p)) for n, p in model.named_parameters(remove_duplicate=False)]
    runner._setup(model)
    runner._check_aliases()
    aliases = runner._aliases
    assert all(a.data_ptr() == p.data_ptr() and a is not p
               for a, p in zip(aliases, runner._params))
    loss_a = runner._run(model, sample, crit._losses)[0]
    # every slot (the shared embedding has three) holds its parameter again
    assert [(n, id(p)) for n, p in model.named_parameters(remove_duplicate=False)] == slots
    grads = torch.autograd.grad(loss_a, aliases, allow_unused=True)
    loss_p = crit._losses(model, sample)[0]
    loss_p.backward()
    assert torch.equal(loss_a, loss_p)
    for (name, p), g in zip(model.named_parameters(), grads):
        want = p.grad if p.grad is not None else torch.zeros_like(p)
        got = g if g is not None else torch.zeros_like(p)
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7), name  # same ops, same order
    runner._check_aliases()
    assert runner._aliases is aliases  # storage unchanged: same aliases
    p0 = runner._params[0]
    p0.data = p0.data.clone()
    runner._check_aliases()
    assert runner._aliases is not aliases and runner._aliases[0].data_ptr() == p0.data_ptr()


class _StandInBackward:
    """A replayed backward graph's stand-in on CPU: ``step(flat)`` on every flat gradient buffer."""

    def __init__(self, flats, step):
        self.flats, self.step = flats, step

    def replay(self):
        for flat in self.flats:
            self.step(flat)


def _runner_with_stand_in(dictionary, step, overwrites):
    """A criterion's graph runner set up on a tiny model, a stand-in shape's graphs (backward:
    ``step`` on every flat buffer) and the flat buffers filled with stale values (5)."""
    crit = LSLabelSmoothedCrossEntropyCriterion(DummyTask(dictionary), sentence_avg=False,
                                                label_smoothing=0.1, ls_cuda_graphs=True)
    runner = crit.graphs
    runner._setup(build_model("ls_transformer", dictionary, TINY, seed=3))
    graphs = SimpleNamespace(grad_output=torch.zeros(()),
                             bwd=_StandInBackward(runner._flats, step), overwrites=overwrites)
    for flat in runner._flats:
        flat.fill_(5)  # stale values from an earlier update
    return runner, graphs


def test_cuda_graphs_replay_backward_bookkeeping(dictionary):
    """Where a replayed backward's gradients land, on CPU with a stand-in backward graph that adds
    1 to every accumulator: fairseq's zero_grad (all .grad None) gives fresh zeroed accumulators;
    a None .grad among others gets its zeroed accumulator; a .grad allocated elsewhere is added
    to; accumulators already in .grad keep accumulating (--update-freq)."""
    runner, graphs = _runner_with_stand_in(dictionary, lambda flat: flat.add_(1), False)
    params = runner._params
    runner._replay_backward(graphs, torch.tensor(2.0))
    assert float(graphs.grad_output) == 2.0
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in params)
    assert all(p.grad.data_ptr() == a.data_ptr() for p, a in zip(params, runner._accumulators))
    runner._replay_backward(graphs, torch.tensor(1.0))  # second micro-batch: accumulates
    assert all(torch.equal(p.grad, torch.full_like(p, 2)) for p in params)
    params[0].grad = None
    params[1].grad = torch.full_like(params[1], 7.0)  # someone else's tensor
    foreign = params[1].grad
    runner._replay_backward(graphs, torch.tensor(1.0))
    assert torch.equal(params[0].grad, torch.ones_like(params[0]))
    assert params[1].grad is foreign and torch.equal(foreign, torch.full_like(foreign, 8))
    assert all(torch.equal(p.grad, torch.full_like(p, 3)) for p in params[2:])


def test_cuda_graphs_overwriting_backward_bookkeeping(dictionary):
    """The same with a stand-in backward graph that overwrites every accumulator with 1 (as one
    captured at an update's first micro-batch does): at the start of an update the stale values
    are not zeroed first, they are overwritten; at a later micro-batch of the update the earlier
    gradients are added back after the replay, and the runner switches to adding (the graphs
    that overwrite are dropped)."""
    runner, graphs = _runner_with_stand_in(dictionary, lambda flat: flat.fill_(1), True)
    runner._graphs["shape"] = graphs
    params = runner._params
    runner._replay_backward(graphs, torch.tensor(2.0))
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in params)
    assert all(p.grad.data_ptr() == a.data_ptr() for p, a in zip(params, runner._accumulators))
    assert not runner._accumulating and "shape" in runner._graphs
    runner._replay_backward(graphs, torch.tensor(1.0))  # second micro-batch: 1 + 1
    assert all(torch.equal(p.grad, torch.full_like(p, 2)) for p in params)
    assert runner._accumulating and not runner._graphs
    assert runner.stats["dropped_overwriting"] == 1


@pytest.mark.parametrize("report_accuracy", [False, True])
def test_reduce_metrics_logs_what_fairseq_logs(dictionary, report_accuracy):
    """reduce_metrics reads host copies of the logged scalars where they exist (CUDA; see
    tests/gpu/test_host_scalars_cuda.py); on CPU scalars it logs exactly fairseq's values."""
    from fairseq.logging import metrics

    task = DummyTask(dictionary)
    kwargs = dict(sentence_avg=False, label_smoothing=0.1, report_accuracy=report_accuracy)
    model = build_model("ls_transformer", dictionary, TINY, seed=3)
    crit = LSLabelSmoothedCrossEntropyCriterion(task, **kwargs)
    g = torch.Generator().manual_seed(11)
    outs = [run_criterion(crit, model, _sample(dictionary, g))[2] for _ in range(2)]
    values = []
    for cls in (LSLabelSmoothedCrossEntropyCriterion, LabelSmoothedCrossEntropyCriterion):
        with metrics.aggregate(new_root=True) as agg:
            cls.reduce_metrics(outs)
            values.append(agg.get_smoothed_values())
    assert values[0].pop("tflops") == 0.0  # the model FLOPs (no wps meter here: no time)
    assert values[0] == values[1]
    assert ("accuracy" in values[0]) == report_accuracy


def test_reduce_metrics_logs_model_tflops_and_mfu(dictionary, monkeypatch):
    """tflops = the logged model FLOPs over the wps meter's time; mfu = its share of the peak of
    all GPUs, in percent (tests/test_flops.py checks the FLOPs themselves)."""
    from types import SimpleNamespace

    from fairseq.logging import metrics

    import ls_fairseq.criterions.ls_label_smoothed_cross_entropy as module

    monkeypatch.setattr(module.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(module.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(module, "device_peak_tflops", lambda index: 800.0)
    monkeypatch.setattr(module, "several_workers", lambda: False)
    logs = [{"loss": 1.0, "nll_loss": 1.0, "ntokens": 10, "nsentences": 2, "sample_size": 10,
             "ls_flops": 1.5e12}, {"loss": 1.0, "nll_loss": 1.0, "ntokens": 10, "nsentences": 2,
                                   "sample_size": 10, "ls_flops": 0.5e12}]
    with metrics.aggregate(new_root=True) as agg:
        LSLabelSmoothedCrossEntropyCriterion.reduce_metrics(logs)
        agg.add_meter("wps", SimpleNamespace(elapsed_time=0.004, smoothed_value=0), priority=90)
        values = agg.get_smoothed_values()
    assert values["tflops"] == 500.0  # 2e12 FLOPs in 4 ms
    assert values["mfu"] == 62.5  # of 800 TFLOP/s
    assert "_ls_flops" not in values


def test_tflops_and_mfu_read_the_running_clock_once(dictionary, monkeypatch):
    """fairseq's wps meter is a running clock: tflops and mfu, derived one after the other, must
    divide by the same seconds (a second read drifted mfu off tflops / peak)."""
    from fairseq.logging import metrics

    import ls_fairseq.criterions.ls_label_smoothed_cross_entropy as module

    monkeypatch.setattr(module.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(module.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(module, "device_peak_tflops", lambda index: 989.4)
    monkeypatch.setattr(module, "several_workers", lambda: False)

    class RunningClock:  # like fairseq's TimeMeter: each read is later than the last
        def __init__(self):
            self.n, self.start, self.reads = 1, 0.0, 0
            self.smoothed_value = 0

        @property
        def elapsed_time(self):
            self.reads += 1
            return 0.1 + 0.0005 * self.reads

    def log(flops, clock):
        with metrics.aggregate(new_root=True) as agg:
            LSLabelSmoothedCrossEntropyCriterion.reduce_metrics(
                [{"loss": 1.0, "nll_loss": 1.0, "ntokens": 10, "nsentences": 2,
                  "sample_size": 10, "ls_flops": flops}])
            agg.add_meter("wps", clock, priority=90)
            return agg.get_smoothed_values()

    clock = RunningClock()
    for flops in (7.5e12, 7.6e12):  # two log events: the clock is read once per event
        values = log(flops, clock)
        seconds = 0.1 + 0.0005 * clock.reads
        assert values["tflops"] == round(flops / seconds / 1e12, 1)
        assert values["mfu"] == round(100 * flops / seconds / 1e12 / 989.4, 1)
    assert clock.reads == 2
