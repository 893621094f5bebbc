"""``--ls-cuda-graphs-memory``: the arena's size estimate, the flag, and the gradient-free forward
that grows the model's lazy state before a capture (``_grow_lazy_state``). What the arena and the
release do to the device memory is measured on the GPU (tests/gpu/test_graph_memory_cuda.py,
bench/graph_memory.py)."""
import pytest
import torch

from fairseq_helpers import DummyTask, build_model, make_dictionary, random_batch  # noqa: E402
from ls_fairseq.criterions.ls_label_smoothed_cross_entropy import (  # noqa: E402
    LSLabelSmoothedCrossEntropyCriterion,
)
from ls_fairseq.graphs import CudaGraphedLoss  # noqa: E402
from ls_fairseq.graphs import memory as graph_memory  # noqa: E402
from ls_fairseq.graphs.memory import expected_need, token_counts  # noqa: E402

# CudaGraphedLoss's shapes of a translation batch: prev_output_tokens, src_lengths, src_tokens,
# target
def _shapes(rows, src_len, tgt_len):
    return [(rows, tgt_len), (rows,), (rows, src_len), (rows, tgt_len)]


def test_token_counts_count_token_tensors_only():
    assert token_counts(_shapes(8, 30, 20)) == (160, 240, 160)
    assert token_counts([(5,), (3, 4, 2)]) == (24,)
    assert token_counts([(7,)]) == ()


@pytest.mark.parametrize("shape,scale", [
    ((8, 30, 20), 1.0),     # the unit's own shape
    ((4, 30, 20), 0.5),     # half the tokens of each side
    ((8, 60, 20), 2.0),     # twice the source tokens
    ((16, 30, 25), 2.5),    # the target grows most: 16 * 25 / (8 * 20)
    ((6, 50, 10), 1.25),    # more source, less target: the larger ratio counts
])
def test_expected_need_scales_with_the_largest_token_ratio(shape, scale):
    unit = (1000, token_counts(_shapes(8, 30, 20)))
    assert expected_need(unit, _shapes(*shape)) == int(1000 * scale * graph_memory.HEADROOM)


def test_expected_need_without_a_comparable_unit():
    assert expected_need(None, _shapes(8, 30, 20)) is None
    unit = (1000, token_counts(_shapes(8, 30, 20)))
    assert expected_need(unit, [(8, 30)]) is None  # other inputs than the unit's
    assert expected_need(unit, [(8,), (8,)]) is None  # no token tensors


def test_memory_flag_is_checked():
    with pytest.raises(ValueError, match="--ls-cuda-graphs-memory must be one of compact, grow"):
        CudaGraphedLoss(memory="tight")
    d = make_dictionary(29)
    for memory in graph_memory.MEMORY_CHOICES:
        crit = LSLabelSmoothedCrossEntropyCriterion(DummyTask(d), 0, 0.1, ls_cuda_graphs=True,
                                                    ls_cuda_graphs_memory=memory)
        assert crit.graphs.memory == memory


def test_memory_flag_through_fairseq_parser():
    from fairseq import options
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, [
        "/nonexistent", "--arch", "ls_transformer", "--task", "translation", "--criterion",
        "ls_label_smoothed_cross_entropy", "--ls-cuda-graphs", "--ls-cuda-graphs-memory",
        "grow"])
    assert args.ls_cuda_graphs_memory == "grow"
    args = options.parse_args_and_arch(options.get_training_parser(), [
        "/nonexistent", "--arch", "ls_transformer", "--task", "translation", "--criterion",
        "ls_label_smoothed_cross_entropy"])
    assert args.ls_cuda_graphs_memory == "compact"
    with pytest.raises(SystemExit):
        options.parse_args_and_arch(options.get_training_parser(), [
            "/nonexistent", "--arch", "ls_transformer", "--task", "translation", "--criterion",
            "ls_label_smoothed_cross_entropy", "--ls-cuda-graphs-memory", "tight"])


@pytest.fixture
def cpu_rng(monkeypatch):
    """The CUDA RNG calls of _grow_lazy_state, on this machine's CPU generator."""
    calls = []
    monkeypatch.setattr(torch.cuda, "get_rng_state",
                        lambda: (calls.append("get"), torch.get_rng_state())[1])
    monkeypatch.setattr(torch.cuda, "set_rng_state",
                        lambda s: (calls.append("set"), torch.set_rng_state(s)))
    return calls


def test_grow_lazy_state_grows_tables_without_gradients(cpu_rng):
    """The gradient-free forward runs the model in eval mode without autograd, grows the
    sinusoidal positional tables as a training step of that shape would (16 positions ->
    enough for 29 source and 31 target tokens), and puts back the training mode and the RNG."""
    d = make_dictionary(41)
    model = build_model("ls_transformer", d, [
        "--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "16",
        "--encoder-ffn-embed-dim", "24", "--encoder-attention-heads", "2",
        "--decoder-attention-heads", "2", "--max-source-positions", "16",
        "--max-target-positions", "16", "--dropout", "0.3"]).train()
    src, src_lengths, prev, tgt = random_batch(d, 3, 29, 31, generator=torch.Generator()
                                               .manual_seed(0))
    sample = {"net_input": {"src_tokens": src, "src_lengths": src_lengths,
                            "prev_output_tokens": prev}, "target": tgt}
    seen = []

    def compute(m, s):
        seen.append((m.training, torch.is_grad_enabled()))
        out = m(**s["net_input"])
        torch.rand(3)  # a draw from the generator, undone afterwards
        return out[0].float().sum(), None, None, None

    runner = CudaGraphedLoss(capture_first_sighting=True)
    state = torch.get_rng_state()
    runner._grow_lazy_state(model, sample, compute)
    assert seen == [(False, False)]
    assert model.training and all(m.training for m in model.modules())
    assert torch.equal(torch.get_rng_state(), state) and cpu_rng == ["get", "set"]
    assert runner.stats["dry_run"] == 1
    assert len(model.encoder.embedding._outgrown) == 1
    assert len(model.decoder.embedding._outgrown) == 1
    assert model.encoder.embed_positions.weights.size(0) >= d.pad() + 1 + 29
    assert model.decoder.embed_positions.weights.size(0) >= d.pad() + 1 + 31


def test_grow_lazy_state_restores_training_mode_on_error(cpu_rng):
    model = torch.nn.Linear(2, 2).train()

    def compute(m, s):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        CudaGraphedLoss(capture_first_sighting=True)._grow_lazy_state(model, {}, compute)
    assert model.training and cpu_rng == ["get", "set"]
