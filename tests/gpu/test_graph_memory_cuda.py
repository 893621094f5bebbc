"""``--ls-cuda-graphs-memory``: the graphs' arena and the release of the eager cache.

Compact memory changes where tensors live, never what is computed: replays still match eager
steps (same tolerances as ``test_cuda_graphs_cuda.py``, whose tests run with the default,
``compact``). What it must change is measured with the allocator's own snapshot: the capture
stream's warm-up cache is given back, and the graphs' pool plus that cache hold less than with
``grow`` for the same shapes.
"""
import pytest
import torch

from fairseq_helpers import DummyTask, build_model  # noqa: E402
from test_cuda_graphs_cuda import SMALL, _assert_replays_match_eager, _sample  # noqa: E402
from ls_fairseq.criterions.ls_label_smoothed_cross_entropy import (  # noqa: E402
    LSLabelSmoothedCrossEntropyCriterion,
)
from ls_fairseq.graphs import memory as graph_memory  # noqa: E402

# ``dictionary`` and ``kernels_required`` come from tests/gpu/conftest.py
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernels_required")]

# enough layers and width that one step's activations are a few hundred MB
MEDIUM = ["--encoder-layers", "3", "--decoder-layers", "3", "--encoder-embed-dim", "512",
          "--encoder-ffn-embed-dim", "2048", "--encoder-attention-heads", "8",
          "--decoder-attention-heads", "8", "--share-all-embeddings", "--dropout", "0.1"]
# first sighting captures: each shape no larger in any dimension than the first (eager) one,
# token counts and source/target mixes varying as fairseq's batches do
MEDIUM_SHAPES = [(96, 48, 52), (64, 44, 50), (80, 40, 46), (96, 30, 34), (72, 48, 40),
                 (88, 36, 52), (56, 48, 52), (96, 46, 26), (64, 30, 50), (90, 47, 51)]


def _segments(pool=None, stream=None):
    """Reserved bytes of the allocator's segments in ``pool`` (a handle; None: the default
    pool) on ``stream`` (None: any)."""
    total = 0
    for seg in torch.cuda.memory_snapshot():
        seg_pool = tuple(seg.get("segment_pool_id", (0, 0)))
        if seg_pool != (tuple(pool) if pool is not None else (0, 0)):
            continue
        if stream is not None and seg["stream"] != stream.cuda_stream:
            continue
        total += seg["total_size"]
    return total


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_compact_replays_match_eager(dictionary, dtype, monkeypatch):
    """With an arena (its threshold lowered to 0 for this small model), replays match eager
    steps (graphs off: ``ls_no_cuda_graphs``), and the warm-up's cache was given back."""
    monkeypatch.setattr(graph_memory, "_MIN_ARENA", 0)
    extra = SMALL + ["--dropout", "0.2", "--attention-dropout", "0.2",
                     "--activation-dropout", "0.2"]
    task = DummyTask(dictionary)
    kwargs = dict(sentence_avg=False, label_smoothing=0.1)
    eager = LSLabelSmoothedCrossEntropyCriterion(task, ls_no_cuda_graphs=True, **kwargs)
    graphed = LSLabelSmoothedCrossEntropyCriterion(
        task, ls_cuda_graphs=True, ls_cuda_graphs_capture="first-sighting", **kwargs)
    m1 = build_model("ls_transformer", dictionary, extra, seed=5).cuda().to(dtype).train()
    m2 = build_model("ls_transformer", dictionary, extra, seed=5).cuda().to(dtype).train()
    updates = [[(8, 29, 31)], [(5, 13, 11)], [(8, 29, 30), (5, 13, 11)], [(7, 20, 31)],
               [(8, 29, 31)], [(8, 29, 30)]]
    _assert_replays_match_eager(dictionary, eager, graphed, m1, m2, dtype, updates, seed=700)
    runner = graphed.graphs
    # a capture's step is its first replay; the first step grew the lazy state without
    # gradients and was captured at once
    # update 3 (two micro-batches) drops the three graphs captured so far (they overwrite the
    # accumulators), so the pool starts afresh with an arena of its own, and the two shapes
    # that come back are captured again
    assert dict(runner.stats) == {"dry_run": 1, "captured": 6, "replayed": 7,
                                  "dropped_overwriting": 3}
    assert runner.graph_memory.arena_bytes > 0
    assert runner.graph_memory.stats["released"] >= 1  # after the warm-up


def _held(dictionary, memory):
    """(graphs' pool, capture stream's default-pool cache, arena) bytes after MEDIUM_SHAPES."""
    crit = LSLabelSmoothedCrossEntropyCriterion(
        DummyTask(dictionary), sentence_avg=False, label_smoothing=0.1, ls_cuda_graphs=True,
        ls_cuda_graphs_capture="first-sighting", ls_cuda_graphs_memory=memory)
    model = build_model("ls_transformer", dictionary, MEDIUM, seed=3).cuda().half().train()
    for i, shape in enumerate(MEDIUM_SHAPES + MEDIUM_SHAPES[1:4]):
        for p in model.parameters():
            p.grad = None
        loss, _, _ = crit(model, _sample(dictionary, shape, i))
        (loss * 8.0).backward()
        assert torch.isfinite(loss)
    torch.cuda.synchronize()
    runner = crit.graphs
    first = {"dry_run": 1} if memory == "compact" else {"eager": 1}
    captures = len(MEDIUM_SHAPES) - ("eager" in first)
    assert dict(runner.stats) == {**first, "captured": captures, "replayed": captures + 3}
    held = (_segments(runner.graph_memory.handle), _segments(stream=runner.capture_stream),
            runner.graph_memory.arena_bytes)
    del crit, runner, model, loss
    torch.cuda.empty_cache()
    return held


def test_compact_holds_less_than_grow(dictionary, monkeypatch):
    monkeypatch.setattr(graph_memory, "_MIN_ARENA", 0)
    grow_pool, grow_warm, grow_arena = _held(dictionary, "grow")
    pool, warm, arena = _held(dictionary, "compact")
    print(f"graphs' pool + capture-stream cache, MiB: grow {grow_pool / 2**20:.0f} + "
          f"{grow_warm / 2**20:.0f}, compact {pool / 2**20:.0f} + {warm / 2**20:.0f} "
          f"(arena {arena / 2**20:.0f})")
    assert grow_arena == 0
    assert grow_warm > 32 * 2**20  # the warm-up's activations, cached for the capture stream
    # given back: what is left are cuBLAS's workspaces for the stream (64 MiB on the H100)
    # and small static tensors
    assert warm < 128 * 2**20 and warm < grow_warm / 4
    assert arena > 0
    assert pool + warm < grow_pool + grow_warm


def test_no_arena_when_memory_is_short(dictionary, monkeypatch):
    """If the arena would not leave a GiB free, the pool grows segment by segment as with
    ``grow`` (one log line), and training goes on."""
    total = torch.cuda.mem_get_info()[1]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 30, total))
    monkeypatch.setattr(graph_memory, "_MIN_ARENA", 0)
    crit = LSLabelSmoothedCrossEntropyCriterion(
        DummyTask(dictionary), sentence_avg=False, label_smoothing=0.1, ls_cuda_graphs=True,
        ls_cuda_graphs_capture="first-sighting")
    model = build_model("ls_transformer", dictionary, SMALL, seed=5).cuda().train()
    for i, shape in enumerate([(8, 29, 31), (5, 13, 11), (5, 13, 11)]):
        for p in model.parameters():
            p.grad = None
        loss, _, _ = crit(model, _sample(dictionary, shape, i))
        loss.backward()
    assert dict(crit.graphs.stats) == {"dry_run": 1, "captured": 2, "replayed": 3}
    assert crit.graphs.graph_memory.arena_bytes == 0
    assert crit.graphs.graph_memory.arena_tried
