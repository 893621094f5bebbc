"""The flat gradient buffers (ls_fairseq/graphs/flat_gradients.py) and the hand-off between the
training-step engine and the optimizer (ls_fairseq/distributed/exchange.py), on the CPU: the
engine's reducer is found from the model through the trainer's wrappers, the registry does not
keep a model alive, each update's ``GradientExchange`` is handed over once, and after the engine's
bucketed all-reduce ls_adam's ``all_reduce_grads`` path (``flat_all_reduce.all_reduce_flat``)
reduces nothing a second time."""
import gc
import weakref

import pytest
import torch
from fairseq.distributed import LegacyDistributedDataParallel, ModuleProxyWrapper

from fairseq_helpers import DummyTask, build_model, make_dictionary
from ls_fairseq.criterions.ls_label_smoothed_cross_entropy import (
    LSLabelSmoothedCrossEntropyCriterion,
)
from ls_fairseq.distributed import (
    NOTHING, REDUCED, GradientExchange, GradientReducer, all_reduce_flat, exchange_of, reducer_of,
)
from ls_fairseq.distributed import exchange as exchange_module
from ls_fairseq.graphs import FlatGradients

TINY = ["--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "16",
        "--encoder-ffn-embed-dim", "24", "--encoder-attention-heads", "2",
        "--decoder-attention-heads", "2", "--dropout", "0", "--share-all-embeddings"]


class _FakeLegacy(LegacyDistributedDataParallel):
    """Legacy DDP without a process group (a second reduction would fail: there is none)."""

    def __init__(self, module):
        torch.nn.Module.__init__(self)
        self.module, self.world_size, self.process_group = module, 2, None
        self.accumulate_grads = False


def test_layout_is_aligned_views_of_one_buffer_per_dtype():
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2).double(),
                                torch.nn.Linear(2, 7))
    params = list(model.parameters())
    grads = FlatGradients(params)
    assert [f.dtype for f in grads.flats] == [torch.float32, torch.float64]
    assert grads.spans == [(0, 0, 15), (0, 16, 5), (1, 0, 10), (1, 16, 2), (0, 32, 14),
                           (0, 48, 7)]
    assert all(v._base is grads.flats[f] and v.shape == p.shape
               for v, p, (f, _, _) in zip(grads.views, params, grads.spans))
    assert grads.fresh() and not grads.bound()
    assert grads.bind(grads.fresh()) == [] and grads.bound()
    assert grads.holds(grads.flats[1]) and not grads.holds(grads.flats[1].clone())


def test_an_exchange_is_handed_over_once_and_dropped_at_the_next_update():
    grads = FlatGradients(torch.nn.Linear(3, 5).parameters())
    reducer = GradientReducer(grads, bucket_mb=25.0, reduce_bucket=lambda bucket: None)
    assert reducer.take_exchange().kind == NOTHING
    reducer.expect(None, None)  # what an update's last micro-batch does
    grads.bind(grads.fresh())
    reducer.issue()
    exchange = reducer.take_exchange()
    assert exchange.kind == REDUCED and exchange.reduced and not exchange.scattered
    assert exchange.grads is grads and exchange.peer is None
    assert not reducer.take_exchange().reduced  # handed over once
    reducer.expect(None, None)
    reducer.issue()
    reducer.start_update()  # nobody took it: the next update starts without it
    assert reducer.take_exchange().kind == NOTHING
    with pytest.raises(ValueError, match="unknown kind"):
        GradientExchange(grads, "both")


def test_engine_registers_its_flat_gradients_and_all_reduce_grads_finds_them_done():
    dictionary = make_dictionary(51)
    crit = LSLabelSmoothedCrossEntropyCriterion(DummyTask(dictionary), sentence_avg=False,
                                                label_smoothing=0.1, ls_cuda_graphs=True)
    runner = crit.graphs
    model = build_model("ls_transformer", dictionary, TINY, seed=3)
    wrapped = ModuleProxyWrapper(_FakeLegacy(model))
    assert reducer_of(wrapped) is None and exchange_of(wrapped) is None
    assert runner.flat_gradients is None and runner.reducer is None
    runner._setup(wrapped)
    grads, reducer = runner.flat_gradients, runner.reducer
    assert isinstance(grads, FlatGradients) and reducer.grads is grads
    assert reducer_of(wrapped) is reducer and reducer_of(model) is reducer
    grads.bind(grads.fresh())
    for p in grads.params:
        p.grad.fill_(1)
    def times_three(bucket):  # the reduction, swapped (as in tests/gpu/test_cuda_graphs_cuda.py)
        bucket.mul_(3)

    reducer.reduce_bucket = times_three
    reducer.expect(wrapped.module, None)  # what an update's last micro-batch does
    reducer.issue()  # what autograd calls at the end of that backward
    exchange = exchange_of(wrapped)
    assert exchange.reduced and exchange.grads is grads
    assert all_reduce_flat(wrapped, exchange)  # found done: no second reduction (no group)
    assert not exchange_of(wrapped).reduced  # handed over once
    assert all(torch.equal(p.grad, torch.full_like(p, 3)) for p in grads.params)

    # the registry holds no model alive
    gone = weakref.ref(model)
    del crit, runner, model, wrapped, grads, reducer, exchange
    gc.collect()
    assert gone() is None
    assert all(k is not None for k in exchange_module._REGISTRY.keys())
