"""``--ls-cuda-graphs``: replayed training steps vs eager steps of the same criterion and model.

CUDA graphs are on by default for an ls_transformer on a GPU, so every eager reference here
turns them off (``ls_no_cuda_graphs=True``, ``--ls-no-cuda-graphs``) and every graphed arm
requires them (``ls_cuda_graphs=True``, ``--ls-cuda-graphs``). The plain command's defaults are
tested in test_fast_defaults_cuda.py.

The replayed graphs launch the same kernels on the same inputs as the eager step, so with dropout
off losses and gradients agree to rounding (tolerance: relative 1e-5 in fp32, 1e-2 of the
tensor's max in fp16 — cuBLAS may pick another algorithm on the capture stream, which reorders
fp16 sums; fp16 gradients carry ~1e-3 relative rounding). With dropout on, the CUDA generator
advances at every replay exactly as an eager step would, so a replay from the same seed draws
the same masks as the eager step (same tolerances). Attention query/key projection gradients
are measured against their block's value-projection gradient (``fairseq_helpers.grad_err``:
they are rounding error where the softmax gradient cancels).
"""
import contextlib
from types import SimpleNamespace

import pytest
import torch

from fairseq_helpers import (  # noqa: E402
    DummyTask, build_model, grad_err, make_dictionary, random_batch, run_workers,
)
from ls_fairseq.criterions.ls_label_smoothed_cross_entropy import (  # noqa: E402
    LSLabelSmoothedCrossEntropyCriterion,
)
from ls_fairseq.criterions.host_scalars import to_host  # noqa: E402

# ``dictionary`` (203 symbols) and ``kernels_required`` come from tests/gpu/conftest.py
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernels_required")]

SMALL = ["--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "64",
         "--encoder-ffn-embed-dim", "136", "--encoder-attention-heads", "4",
         "--decoder-attention-heads", "4", "--share-all-embeddings"]
SHAPES = [(8, 13, 11), (5, 29, 31), (8, 13, 11), (3, 7, 40), (5, 29, 31), (8, 13, 11),
          (8, 13, 11), (3, 7, 40)]


def _sample(dictionary, shape, seed):
    g = torch.Generator().manual_seed(seed)
    src, src_lengths, prev, tgt = random_batch(dictionary, *shape, generator=g)
    return {
        "net_input": {"src_tokens": src.cuda(), "src_lengths": src_lengths.cuda(),
                      "prev_output_tokens": prev.cuda()},
        "target": tgt.cuda(),
        "ntokens": int(tgt.ne(dictionary.pad()).sum()),
    }


def _pair(dictionary, dtype, dropout, **crit):
    extra = SMALL + ["--dropout", str(dropout), "--attention-dropout", str(dropout),
                     "--activation-dropout", str(dropout)]
    task = DummyTask(dictionary)
    kwargs = dict(sentence_avg=False, label_smoothing=0.1, **crit)
    eager = LSLabelSmoothedCrossEntropyCriterion(task, ls_no_cuda_graphs=True, **kwargs)
    graphed = LSLabelSmoothedCrossEntropyCriterion(task, ls_cuda_graphs=True, **kwargs)
    m1 = build_model("ls_transformer", dictionary, extra, seed=5).cuda().to(dtype).train()
    m2 = build_model("ls_transformer", dictionary, extra, seed=5).cuda().to(dtype).train()
    return eager, graphed, m1, m2


def _rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def _step(crit, model, samples, scale, seed):
    """One update's forward/backward over ``samples`` (update-freq len(samples)), fairseq-style:
    .grad set to None first, loss scaled before backward."""
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(seed)
    logs = []
    for sample in samples:
        loss, _, log = crit(model, sample)
        (loss * scale).backward()
        logs.append((float(to_host(log["loss"])), float(to_host(log["nll_loss"]))))
    return logs, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def _assert_replays_match_eager(dictionary, eager, graphed, m1, m2, dtype, updates, seed):
    """Runs each update (a list of micro-batch shapes) on both criteria and models and compares
    logged losses and gradients, then takes the same optimizer step on both models."""
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    scale = 1.0 if dtype == torch.float32 else 128.0
    for i, shapes in enumerate(updates):
        samples = [_sample(dictionary, shape, seed + 100 * j + i) for j, shape in enumerate(shapes)]
        logs_e, grads_e = _step(eager, m1, samples, scale, seed=i)
        logs_g, grads_g = _step(graphed, m2, samples, scale, seed=i)
        for (le, ne), (lg, ng) in zip(logs_e, logs_g):
            assert abs(lg - le) <= tol * abs(le), (i, shapes, le, lg)
            assert abs(ng - ne) <= tol * abs(ne), (i, shapes, ne, ng)
        assert grads_e.keys() == grads_g.keys()
        for k in grads_e:
            assert grad_err(k, grads_g[k], grads_e) <= tol, (i, shapes, k)
        with torch.no_grad():  # an optimizer step, same on both, so later steps see new weights
            for p1, p2 in zip(m1.parameters(), m2.parameters()):
                p1.add_(p1.grad, alpha=-1e-3 / scale)
                p2.copy_(p1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_replay_matches_eager(dictionary, dtype, dropout):
    eager, graphed, m1, m2 = _pair(dictionary, dtype, dropout)
    warm_ups = []  # the capture stream is warmed up once; later shapes capture without it
    warm_up = graphed.graphs._warm_up
    graphed.graphs._warm_up = lambda *a: (warm_ups.append(1), warm_up(*a))[1]
    # updates of one or two micro-batches (--update-freq 2), shapes seen 1..4 times
    updates = [[shape] + ([SHAPES[(i + 2) % len(SHAPES)]] if i % 3 == 1 else [])
               for i, shape in enumerate(SHAPES)]
    _assert_replays_match_eager(dictionary, eager, graphed, m1, m2, dtype, updates, seed=100)
    # 3 shapes captured at updates of one micro-batch (their backward overwrites the
    # accumulators); the first update of two micro-batches drops them, and they are captured
    # again (adding into the accumulators) when they come back
    assert graphed.graphs.stats["dropped_overwriting"] == 3
    assert graphed.graphs.stats["captured"] == 6
    assert graphed.graphs.stats["replayed"] >= 5
    assert len(warm_ups) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_shape_buckets_replay_batches_of_unseen_shapes(dictionary, dtype):
    """--ls-shape-buckets: seven batches of five different shapes (updates of one and two
    micro-batches) are padded to one shape, so from the second on they replay its graphs (the
    second captures them) although their own shapes were mostly never seen. Losses
    and gradients are those of the unpadded batch run eagerly (dropout 0; tolerances as above)."""
    task = DummyTask(dictionary)
    task.cfg = SimpleNamespace(left_pad_source=True, left_pad_target=False)
    extra = SMALL + ["--dropout", "0"]
    eager = LSLabelSmoothedCrossEntropyCriterion(task, sentence_avg=False, label_smoothing=0.1,
                                                 ls_no_cuda_graphs=True)
    graphed = LSLabelSmoothedCrossEntropyCriterion(task, sentence_avg=False, label_smoothing=0.1,
                                                   ls_cuda_graphs=True, ls_shape_buckets=4,
                                                   ls_shape_bucket_slack=0.5)
    m1 = build_model("ls_transformer", dictionary, extra, seed=5).cuda().to(dtype).train()
    m2 = build_model("ls_transformer", dictionary, extra, seed=5).cuda().to(dtype).train()
    # (8, 13, 11) pads to (8, 14, 12); the others fit in it within 1.5x their token slots
    shapes = [(8, 13, 11), (7, 14, 12), (8, 12, 10), (6, 13, 12), (8, 13, 12)]
    updates = [[shape] + ([shapes[(i + 1) % len(shapes)]] if i % 2 == 1 else [])
               for i, shape in enumerate(shapes)]
    _assert_replays_match_eager(dictionary, eager, graphed, m1, m2, dtype, updates, seed=300)
    assert graphed.shape_buckets.shapes == [(8, 14, 12)]
    # the first step grows the lazy state without gradients, then is captured (compact memory);
    # the first update of two micro-batches drops that graph (it overwrites the accumulators)
    # and the next step captures the shape again
    assert dict(graphed.graphs.stats) == {"dry_run": 1, "captured": 2, "replayed": 7,
                                          "dropped_overwriting": 1}


@pytest.mark.parametrize("memory", ["compact", "grow"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_first_sighting_captures_match_eager(dictionary, dtype, memory):
    """--ls-cuda-graphs-capture first-sighting: a new shape no larger in any dimension than the
    steps run so far is captured at once (the step is the capture's first replay). The first
    step and larger shapes run eagerly first (``--ls-cuda-graphs-memory grow``), or grow the
    lazy state in a forward without gradients and are captured at once (``compact``). The
    positional tables start small (16 positions), so the longer steps grow them after some
    graphs were captured: those graphs' later replays read the outgrown tables. Losses and
    gradients match eager steps (dropout 0.2: replays draw the eager steps' masks, and the
    gradient-free forwards draw none; tolerances as above)."""
    extra = SMALL + ["--dropout", "0.2", "--attention-dropout", "0.2", "--activation-dropout",
                     "0.2", "--max-source-positions", "16", "--max-target-positions", "16"]
    task = DummyTask(dictionary)
    kwargs = dict(sentence_avg=False, label_smoothing=0.1)
    eager = LSLabelSmoothedCrossEntropyCriterion(task, ls_no_cuda_graphs=True, **kwargs)
    graphed = LSLabelSmoothedCrossEntropyCriterion(
        task, ls_cuda_graphs=True, ls_cuda_graphs_capture="first-sighting",
        ls_cuda_graphs_memory=memory, **kwargs)
    m1 = build_model("ls_transformer", dictionary, extra, seed=5).cuda().to(dtype).train()
    m2 = build_model("ls_transformer", dictionary, extra, seed=5).cuda().to(dtype).train()
    # updates of several micro-batches from the start: every graph adds into the accumulators,
    # so the counts below follow the capture policy alone (test_overwriting_backward_graphs
    # covers the graphs that overwrite them)
    graphed.graphs._accumulating = True
    updates = [[(8, 29, 31)],                # grow: eager (nothing ran before); compact: captured
               [(5, 13, 11)],                # captured at its first sighting
               [(3, 7, 20), (5, 13, 11)],    # captured; replayed
               [(8, 29, 31)],                # grow: captured (second sighting); compact: replayed
               [(9, 13, 11)],                # more rows than any step so far: as the first
               [(6, 40, 12)],                # a longer source (its table grows): as the first
               [(9, 13, 11), (3, 7, 20)],    # grow: captured; replayed (captured before growth)
               [(5, 13, 11), (6, 40, 12)]]   # replayed; grow: captured
    _assert_replays_match_eager(dictionary, eager, graphed, m1, m2, dtype, updates, seed=500)
    if memory == "grow":
        assert dict(graphed.graphs.stats) == {"eager": 3, "captured": 5, "replayed": 8}
    else:
        assert dict(graphed.graphs.stats) == {"dry_run": 3, "captured": 5, "replayed": 11}
    assert len(m2.encoder.embedding._outgrown) == 2  # grown at (8, 29, 31) and (6, 40, 12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_overwriting_backward_graphs(dictionary, dtype):
    """A shape captured at an update's first micro-batch writes the gradients into the
    accumulators instead of adding them (no zeroing of the flat buffers before its replays). The
    buffers are filled with NaN before every update here: any accumulator the replay does not
    write (including that of a parameter without a gradient, which the graph zeroes; eager steps
    zero it too) would show.
    Then an update of two micro-batches whose second replays such a graph: the earlier gradient
    is added back, the overwriting graphs are dropped, and later captures add. Gradients match
    eager steps throughout (tolerances as above; dropout 0.2)."""
    eager, graphed, m1, m2 = _pair(dictionary, dtype, 0.2)
    for m in (m1, m2):  # a parameter the loss does not use: no gradient
        m.register_parameter("unused",
                             torch.nn.Parameter(torch.ones(5, device="cuda", dtype=dtype)))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    scale = 1.0 if dtype == torch.float32 else 128.0
    a, b = (4, 9, 7), (6, 5, 12)
    updates = [[a], [a], [b], [b], [a], [b], [a, b], [a], [b, a]]
    for i, shapes in enumerate(updates):
        flat = graphed.graphs.flat_gradients
        for acc in flat.views if flat is not None else []:  # last update's gradients, stale
            acc.fill_(float("nan"))
        samples = [_sample(dictionary, s, 700 + 10 * i + k) for k, s in enumerate(shapes)]
        _, want = _step(eager, m1, samples, scale, seed=i)
        _, got = _step(graphed, m2, samples, scale, seed=i)
        assert torch.equal(got.pop("unused"), torch.zeros_like(m2.unused)), i
        assert want.keys() == got.keys(), i
        for k in want:
            assert grad_err(k, got[k], want) <= tol, (i, shapes, k)
        if i == 5:  # a and b captured at updates of one micro-batch
            assert all(g.overwrites for g in graphed.graphs.captured.values())
            assert graphed.graphs.stats["captured"] == 2
        with torch.no_grad():
            for p1, p2 in zip(m1.parameters(), m2.parameters()):
                if p1.grad is not None:
                    p1.add_(p1.grad, alpha=-1e-3 / scale)
                p2.copy_(p1)
    stats = graphed.graphs.stats
    assert stats["dropped_overwriting"] == 2 and stats["captured"] == 4, dict(stats)
    assert not any(g.overwrites for g in graphed.graphs.captured.values())


def test_replays_draw_new_dropout_masks(dictionary):
    _, graphed, _, model = _pair(dictionary, torch.float32, 0.3)
    sample = _sample(dictionary, (6, 17, 19), 1)
    losses = []
    for _ in range(4):
        loss, _, _ = graphed(model, sample)
        loss.backward()
        losses.append(float(loss))
    assert graphed.graphs.stats["replayed"] == 3  # sighting 1 eager, 2 captured + replayed
    assert losses[2] != losses[3], "two replays drew the same dropout masks"


def test_zero_loss_gradient_and_foreign_grads(dictionary):
    """fairseq's dummy batches do ``loss *= 0`` before backward: the replay adds zero
    gradients. A .grad allocated elsewhere is added to, not replaced."""
    eager, graphed, m1, m2 = _pair(dictionary, torch.float32, 0.0)
    sample = _sample(dictionary, (4, 9, 10), 3)
    for _ in range(2):  # capture
        graphed(m2, sample)[0].backward()
    for p in m2.parameters():
        p.grad = torch.ones_like(p)
    loss, _, _ = graphed(m2, sample)
    loss *= 0
    loss.backward()
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in m2.parameters())
    loss, _, _ = graphed(m2, sample)
    loss.backward()
    eager(m1, sample)[0].backward()
    # absolute, against the model's largest gradient: the +1 rounds each entry to ~6e-8, and
    # some gradients (k_proj.bias: softmax is shift-invariant) are zero up to rounding
    scale = max(float(p.grad.abs().max()) for p in m1.parameters())
    for (k, p1), p2 in zip(m1.named_parameters(), m2.parameters()):
        assert float((p2.grad - 1 - p1.grad).abs().max()) <= 1e-5 * scale, k


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_capture_while_an_eager_graph_is_alive(dictionary, dtype):
    """A loss of an earlier eager step still held (with its autograd graph) while a shape is
    captured: the parameters' gradient-accumulator nodes then belong to the default stream.
    Capture must still work (it runs on aliases of the parameters) and give eager's gradients."""
    eager, graphed, m1, m2 = _pair(dictionary, dtype, 0.0)
    sample = _sample(dictionary, (7, 21, 23), 9)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    held = []
    for _ in range(3):  # eager, captured + replayed, replayed
        for p in m2.parameters():
            p.grad = None
        loss, _, _ = graphed(m2, sample)
        loss.backward()
        held.append(loss)
    assert graphed.graphs.stats["captured"] == 1 and graphed.graphs.stats["replayed"] == 2
    eager(m1, sample)[0].backward()
    for (k, p1), p2 in zip(m1.named_parameters(), m2.parameters()):
        assert _rel(p2.grad, p1.grad) <= tol, k


def test_replaced_parameter_storage_recaptures(dictionary):
    """``p.data = ...`` (e.g. a checkpoint loader that replaces tensors) invalidates the graphs,
    which read the old storage: they are dropped and the shape is captured again."""
    eager, graphed, m1, m2 = _pair(dictionary, torch.float32, 0.0)
    sample = _sample(dictionary, (4, 9, 10), 3)
    for _ in range(3):
        graphed(m2, sample)[0].backward()
    with torch.no_grad():
        for p1, p2 in zip(m1.parameters(), m2.parameters()):
            p1.mul_(1.5)
            p2.data = p1.data.clone()  # new storage, new values
    for p in list(m1.parameters()) + list(m2.parameters()):
        p.grad = None
    for _ in range(3):  # the sighting counter is kept: captured again at once, then replayed
        for p in m2.parameters():
            p.grad = None
        loss, _, _ = graphed(m2, sample)
        loss.backward()
    assert graphed.graphs.stats["captured"] == 2
    want = eager(m1, sample)[0]
    want.backward()
    assert abs(float(loss) - float(want)) <= 1e-5 * abs(float(want))
    for (k, p1), p2 in zip(m1.named_parameters(), m2.parameters()):
        assert _rel(p2.grad, p1.grad) <= 1e-5, k


def test_second_forward_before_backward_runs_eagerly(dictionary):
    """Two forwards before their backwards: the second must not overwrite the activations the
    first replay's backward still needs (shared memory pool), so it runs eagerly."""
    eager, graphed, m1, m2 = _pair(dictionary, torch.float32, 0.0)
    a, b = _sample(dictionary, (4, 9, 10), 3), _sample(dictionary, (4, 9, 10), 4)
    for _ in range(2):
        graphed(m2, a)[0].backward()
    for p in m2.parameters():
        p.grad = None
    la, _, _ = graphed(m2, a)
    lb, _, _ = graphed(m2, b)
    assert graphed.graphs.stats["eager"] == 2  # the first sighting, and b while a was pending
    (la + lb).backward()
    (eager(m1, a)[0] + eager(m1, b)[0]).backward()
    for (k, p1), p2 in zip(m1.named_parameters(), m2.parameters()):
        assert _rel(p2.grad, p1.grad) <= 1e-5, k


def test_least_recently_used_graphs_dropped(dictionary):
    task = DummyTask(dictionary)
    crit = LSLabelSmoothedCrossEntropyCriterion(task, sentence_avg=False, label_smoothing=0.1,
                                                ls_cuda_graphs=True, ls_cuda_graphs_max=2)
    model = build_model("ls_transformer", dictionary, SMALL + ["--dropout", "0"]).cuda().train()
    for shape in [(2, 5, 6), (2, 5, 6), (3, 5, 6), (3, 5, 6), (4, 5, 6), (4, 5, 6), (2, 5, 6)]:
        crit(model, _sample(dictionary, shape, 0))[0].backward()
    assert len(crit.graphs.captured) == 2
    assert crit.graphs.stats["captured"] == 4  # (2, 5, 6) was dropped, then captured again


@pytest.mark.parametrize("more", [
    ["--ls-no-fused-fp16-copy"],
    ["--ls-fused-fp16-copy", "--ls-no-deferred-overflow-check"],
    ["--ls-shape-buckets", "0", "--ls-no-fused-fp16-copy"],
], ids=["fp16", "fp16_fused_copy", "no_shape_buckets"])
def test_fairseq_train_same_losses(data_bin, tmp_path, more):
    """fairseq-train (--fp16, dropout 0, 9 epochs of a tiny corpus, so batch shapes repeat):
    --ls-cuda-graphs logs the same losses as the eager run, --ls-no-cuda-graphs (fairseq rounds
    them to 3 decimals; tolerance 0.01 absolute for fp16 GEMM reordering on the capture stream
    and for the sums over padded batches, --ls-shape-buckets being on by default). The optimizer
    is named in each case: fairseq's FP16Optimizer around ls_adam (--ls-no-fused-fp16-copy), or
    the fused copy with the overflow check read back every update (the graphs with all three
    defaults against none: test_fast_defaults_cuda.py)."""
    from test_end_to_end import losses, train

    data = data_bin  # tests/conftest.py: one tiny corpus per test run
    common = ["--share-all-embeddings", "--dropout", "0", "--fp16", "--max-epoch", "9",
              "--no-save"] + more
    eager = train(data, tmp_path / "eager", "ls_transformer", common + ["--ls-no-cuda-graphs"],
                  200)
    graphed = train(data, tmp_path / "graphed", "ls_transformer", common + ["--ls-cuda-graphs"],
                    200)
    assert "--ls-cuda-graphs: captured" not in eager
    assert "--ls-cuda-graphs: captured" in graphed
    le, lg = losses(eager), losses(graphed)
    assert len(le) == len(lg) >= 10
    assert max(abs(a - b) for a, b in zip(le, lg)) <= 0.01, (le, lg)


def test_every_training_step_accumulates_into_the_flat_buffers(dictionary):
    """Eager steps (first sightings, a second forward before the first's backward) leave their
    gradients in the same flat buffers as replays, so with several GPUs each rank all-reduces the
    same buffers whatever path its step took (distributed/flat_all_reduce.py)."""
    from ls_fairseq.distributed.flat_all_reduce import flat_grad_buffers

    eager, graphed, m1, m2 = _pair(dictionary, torch.float32, 0.0)
    params = [p for p in m2.parameters() if p.requires_grad]
    seen = None
    for i, shape in enumerate([(4, 9, 7), (4, 9, 7), (6, 5, 12), (4, 9, 7)]):
        sample = _sample(dictionary, shape, 300 + i)
        _, grads_e = _step(eager, m1, [sample], 1.0, seed=i)
        _, grads_g = _step(graphed, m2, [sample], 1.0, seed=i)
        buffers = flat_grad_buffers(params)
        assert buffers is not None, f"step {i} left gradients outside the flat buffers"
        ptrs = sorted(b.data_ptr() for b in buffers)
        assert seen is None or ptrs == seen
        seen = ptrs
        for k in grads_e:
            assert _rel(grads_g[k], grads_e[k]) <= 1e-5, (i, k)
    assert graphed.graphs.stats["eager"] == 2 and graphed.graphs.stats["replayed"] == 2
    # a second forward while the first replayed loss awaits its backward runs eagerly
    for p in m2.parameters():
        p.grad = None
    sample = _sample(dictionary, (4, 9, 7), 400)
    first, _, _ = graphed(m2, sample)
    second, _, _ = graphed(m2, _sample(dictionary, (3, 8, 6), 401))
    (first + second).backward()
    assert graphed.graphs.stats["eager"] == 3
    assert flat_grad_buffers(params) is not None


class _FakeLegacyDDP:
    """fairseq's LegacyDistributedDataParallel without a process group: the runner's bucketed
    all-reduce reads only ``world_size``, ``process_group`` and ``accumulate_grads`` (the
    reduction itself is swapped by the tests)."""

    @staticmethod
    def wrap(model):
        from fairseq.distributed import LegacyDistributedDataParallel, ModuleProxyWrapper

        class Fake(LegacyDistributedDataParallel):
            def __init__(self, module):
                torch.nn.Module.__init__(self)
                self.module, self.world_size, self.process_group = module, 1, None
                self.accumulate_grads = False

        return ModuleProxyWrapper(Fake(model))


def test_bucketed_all_reduce_waits_for_each_bucket(dictionary):
    """Under legacy DDP the gradients are reduced bucket by bucket on a side stream, each bucket
    behind the event the (captured or eager) backward records when the bucket is complete. The
    reduction is swapped for ``x *= 3``: a bucket reduced before all its gradients were added
    would hold g instead of 3g somewhere. Eager first sightings, captures, replays, updates of
    two micro-batches (no reduction inside no_sync) and a replay and an eager forward in one
    backward pass; then ls_adam's all_reduce_grads must find the buffers done (reduces nothing
    more). fp32, tolerance relative 1e-5 (graph vs eager rounding, as above)."""
    from ls_fairseq.distributed import exchange_of, flat_all_reduce

    eager, graphed, m1, m2 = _pair(dictionary, torch.float32, 0.0, ls_all_reduce_bucket_mb=0.02)
    wrapped = _FakeLegacyDDP.wrap(m2)
    ddp = wrapped.module
    reduced = []

    def times_three(bucket):
        bucket.mul_(3)
        reduced.append(bucket.numel())

    graphed.graphs.reduce_bucket = times_three
    updates = [[(4, 9, 7)], [(4, 9, 7)], [(4, 9, 7), (6, 5, 12)], [(6, 5, 12), (4, 9, 7)],
               [(4, 9, 7)], [(5, 11, 13), (5, 11, 13)]]
    for u, shapes in enumerate(updates):
        samples = [_sample(dictionary, s, 500 + 10 * u + k) for k, s in enumerate(shapes)]
        _, want = _step(eager, m1, samples, 1.0, seed=u)
        for p in m2.parameters():
            p.grad = None
        torch.manual_seed(u)
        for k, sample in enumerate(samples):
            ddp.accumulate_grads = k < len(samples) - 1  # fairseq's no_sync()
            loss, _, _ = graphed(wrapped, sample)
            loss.backward()
        ddp.accumulate_grads = False
        # ls_adam's all_reduce_grads: the update's exchange says the buffers are done
        assert flat_all_reduce.all_reduce_flat(wrapped, exchange_of(wrapped))
        for k, p in m2.named_parameters():
            assert _rel(p.grad, 3 * want[k]) <= 1e-5, (u, k, _rel(p.grad, 3 * want[k]))
    stats = graphed.graphs.stats
    assert stats["overlapped_all_reduce"] == len(updates)
    # under legacy DDP every backward graph adds into the accumulators (none overwrites them)
    assert "dropped_overwriting" not in stats
    assert stats["replayed"] >= 3 and stats["captured"] == 3
    assert not any(g.overwrites for g in graphed.graphs.captured.values())
    buckets = graphed.graphs.reducer.buckets.buckets
    assert len(buckets) >= 4 and sum(reduced) == len(updates) * sum(h - lo for _, lo, h in buckets)
    # a replayed and an eager forward ending in one backward pass: wait for the whole pass
    for p in m2.parameters():
        p.grad = None
    a, b = _sample(dictionary, (4, 9, 7), 900), _sample(dictionary, (3, 8, 6), 901)
    la, _, _ = graphed(wrapped, a)
    lb, _, _ = graphed(wrapped, b)
    (la + lb).backward()
    assert flat_all_reduce.all_reduce_flat(wrapped, exchange_of(wrapped))
    for p in m1.parameters():
        p.grad = None
    (eager(m1, a)[0] + eager(m1, b)[0]).backward()
    for (k, p1), p2 in zip(m1.named_parameters(), m2.parameters()):
        assert _rel(p2.grad, 3 * p1.grad) <= 1e-5, k


def _multi_gpu_worker(rank, wrapper, world):
    """``wrapper``: "legacy" (fairseq's LegacyDistributedDataParallel) or "torch" (torch DDP,
    fairseq's default backend: the engine runs the steps inside DDP and all-reduces itself)."""
    import torch.distributed as dist
    from fairseq.distributed import LegacyDistributedDataParallel, ModuleProxyWrapper

    from ls_fairseq.distributed import exchange_of, flat_all_reduce

    dictionary = make_dictionary(203)
    eager, graphed, m1, m2 = _pair(dictionary, torch.float32, 0.0, ls_all_reduce_bucket_mb=0.05)
    if wrapper == "torch":
        inner = torch.nn.parallel.DistributedDataParallel(m2, device_ids=[rank])
    else:
        inner = LegacyDistributedDataParallel(m2, dist.group.WORLD)
    wrapped = ModuleProxyWrapper(inner)
    # the ranks see shapes in different orders, so one replays while the other runs eagerly
    order = [(4, 9, 7), (4, 9, 7), (6, 5, 12), (4, 9, 7), (6, 5, 12), (6, 5, 12)]
    shapes = {r: order[r:] + order[:r] for r in range(world)}
    # then two updates of two micro-batches each (--update-freq 2: no_sync on the first)
    pair = [(4, 9, 7), (6, 5, 12)]
    micro_batches = [1] * 6 + [2, 2]
    worst = 0.0
    for u, n in enumerate(micro_batches):
        def batch(r, i):
            shape = shapes[r][u] if n == 1 else pair[(i + r) % 2]
            return _sample(dictionary, shape, 700 + 10 * u + 3 * i + r)
        want = {}
        for r in range(world):  # the reference: every rank's gradients, averaged, on this GPU
            _, g = _step(eager, m1, [batch(r, i) for i in range(n)], 1.0, seed=u)
            for k, v in g.items():
                want[k] = want.get(k, 0) + v / world
        for p in m2.parameters():
            p.grad = None
        for i in range(n):
            last = i == n - 1
            with contextlib.nullcontext() if last else wrapped.no_sync():
                loss, _, _ = graphed(wrapped, batch(rank, i))
                loss.backward()
        assert flat_all_reduce.all_reduce_flat(wrapped, exchange_of(wrapped))
        for k, p in m2.named_parameters():
            worst = max(worst, _rel(p.grad, want[k]))
    # validation goes through the wrapper's own forward (no gradients)
    m2.eval()
    with torch.no_grad():
        val_loss, _, _ = graphed(wrapped, batch(rank, 0))
    return {"worst": worst, "stats": dict(graphed.graphs.stats),
            "val_finite": bool(torch.isfinite(val_loss))}


@pytest.mark.parametrize("wrapper", ["legacy", "torch"])
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_bucketed_all_reduce_matches_the_averaged_gradients(tmp_path, wrapper):
    """Two processes, NCCL, legacy or torch DDP, different batches per rank, updates of one and
    of two micro-batches: after each update both ranks hold the average of the two ranks' eager
    gradients (relative 1e-5, fp32: the same sums in another order), whether a rank replayed or
    ran eagerly (the ranks' shape orders differ, so both mixes occur). Under torch DDP a second
    reduction by DDP's own hooks would halve the gradients and fail this."""
    for rank, r in enumerate(run_workers(tmp_path, _multi_gpu_worker, wrapper, 2,
                                         backend="nccl")):
        assert r["worst"] <= 1e-5, (rank, r)
        assert r["stats"]["overlapped_all_reduce"] == 8 and r["stats"]["replayed"] >= 4, r
        assert r["val_finite"], r
        assert bool(r["stats"].get("inside_torch_ddp")) == (wrapper == "torch"), r


def test_torch_ddp_one_gpu(tmp_path):
    """The torch-DDP path of the engine on one GPU (a process group of one): the gradients are
    the eager ones, replayed and eager steps alike, with update-freq 1 and 2."""
    [r] = run_workers(tmp_path, _multi_gpu_worker, "torch", 1, world=1, backend="nccl")
    assert r["worst"] <= 1e-5, r
    assert r["stats"]["overlapped_all_reduce"] == 8 and r["stats"]["replayed"] >= 4, r
    assert r["stats"]["inside_torch_ddp"] >= 10 and r["val_finite"], r
