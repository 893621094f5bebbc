"""The object between the training-step engine and the optimizer
(ls_fairseq/graphs/flat_gradients.py), on the CPU: the engine's ``FlatGradients`` are found from
the model through the trainer's wrappers, the registry does not keep a model alive, and after the
engine's bucketed all-reduce ls_adam's ``all_reduce_grads`` path
(``flat_all_reduce.all_reduce_flat``) reduces nothing a second time."""
import gc
import weakref

import torch
from fairseq.distributed import LegacyDistributedDataParallel, ModuleProxyWrapper

from fairseq_helpers import DummyTask, build_model, make_dictionary
from ls_fairseq.criterions.ls_label_smoothed_cross_entropy import (
    LSLabelSmoothedCrossEntropyCriterion,
)
from ls_fairseq.graphs import FlatGradients, all_reduce_flat, flat_gradients_of
from ls_fairseq.graphs import flat_gradients as flat_gradients_module

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
    assert grads.fresh() and not grads.bound() and not grads.all_reduced
    grads.all_reduced = True
    assert grads.bind(grads.fresh()) == [] and grads.bound()
    assert not grads.all_reduced  # the start of an update takes the mark off
    assert grads.holds(grads.flats[1]) and not grads.holds(grads.flats[1].clone())


def test_engine_registers_its_flat_gradients_and_all_reduce_grads_finds_them_done():
    dictionary = make_dictionary(51)
    crit = LSLabelSmoothedCrossEntropyCriterion(DummyTask(dictionary), sentence_avg=False,
                                                label_smoothing=0.1, ls_cuda_graphs=True)
    runner = crit.graphs
    model = build_model("ls_transformer", dictionary, TINY, seed=3)
    wrapped = ModuleProxyWrapper(_FakeLegacy(model))
    assert flat_gradients_of(wrapped) is None and runner.flat_gradients is None
    runner._setup(wrapped)
    grads = runner.flat_gradients
    assert isinstance(grads, FlatGradients)
    assert flat_gradients_of(wrapped) is grads and flat_gradients_of(model) is grads
    assert runner._params is grads.params and runner._flats is grads.flats
    grads.bind(grads.fresh())
    for p in grads.params:
        p.grad.fill_(1)
    def times_three(bucket):  # the reduction, swapped (as in tests/gpu/test_cuda_graphs_cuda.py)
        bucket.mul_(3)

    runner.reduce_bucket = times_three
    runner._expect_reduce(wrapped.module, None)  # what an update's last micro-batch does
    runner._all_reduce()
    assert grads.all_reduced
    assert all_reduce_flat(wrapped)  # found done: no second reduction (there is no group)
    assert not grads.all_reduced
    assert all(torch.equal(p.grad, torch.full_like(p, 3)) for p in grads.params)

    # the registry holds no model alive
    gone = weakref.ref(model)
    del crit, runner, model, wrapped, grads
    gc.collect()
    assert gone() is None
    assert all(k is not None for k in flat_gradients_module._REGISTRY.keys())
