"""The model-FLOP formula behind the logged ``tflops``/``mfu`` (ls_fairseq/flops.py) against
PyTorch's FlopCounterMode count of one forward+backward, for fairseq's ``transformer`` and for
``ls_transformer`` (its PyTorch path), on batches without padding (the counter sees padded
shapes; the formula counts real tokens), and the logged fields of the criterion.

Tolerance: 0.5%, though both count the same matrix multiplies (they agree exactly today): room
for a counter that also counts some small op outside them."""
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from fairseq_helpers import DummyTask, build_model, make_dictionary
from ls_fairseq.criterions.ls_label_smoothed_cross_entropy import (
    LSLabelSmoothedCrossEntropyCriterion,
)
from ls_fairseq.flops import TransformerFlops, peak_tflops

DIMS = [  # odd sizes, different encoder/decoder depths and widths
    ["--encoder-layers", "2", "--decoder-layers", "3", "--encoder-embed-dim", "24",
     "--decoder-embed-dim", "24", "--encoder-ffn-embed-dim", "40", "--decoder-ffn-embed-dim", "56",
     "--encoder-attention-heads", "4", "--decoder-attention-heads", "2", "--dropout", "0"],
    ["--encoder-layers", "1", "--decoder-layers", "2", "--encoder-embed-dim", "32",
     "--decoder-embed-dim", "16", "--encoder-ffn-embed-dim", "24", "--decoder-ffn-embed-dim", "48",
     "--encoder-attention-heads", "4", "--decoder-attention-heads", "4", "--dropout", "0",
     "--decoder-output-dim", "16"],
]


def _full_batch(dictionary, bsz, src_len, tgt_len, seed):
    g = torch.Generator().manual_seed(seed)
    low, high = dictionary.nspecial, len(dictionary)
    src = torch.randint(low, high, (bsz, src_len), generator=g)
    tgt = torch.randint(low, high, (bsz, tgt_len), generator=g)
    src[:, -1] = tgt[:, -1] = dictionary.eos()
    prev = torch.cat([torch.full((bsz, 1), dictionary.eos()), tgt[:, :-1]], 1)
    return {"net_input": {"src_tokens": src, "src_lengths": torch.full((bsz,), src_len),
                          "prev_output_tokens": prev},
            "target": tgt, "ntokens": bsz * tgt_len}


def _counted(model, sample):
    criterion = LSLabelSmoothedCrossEntropyCriterion(
        DummyTask(make_dictionary()), sentence_avg=False, label_smoothing=0.1,
        ls_no_cuda_graphs=True)
    model.train()
    # the math backend of scaled_dot_product_attention: matrix multiplies the counter sees (on
    # the CPU the fused kernel fairseq's attention would call is not counted)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        loss, _, log = criterion(model, sample)
        loss.backward()
    return counter.get_total_flops(), log


@pytest.mark.parametrize("arch", ["transformer", "ls_transformer"])
@pytest.mark.parametrize("dims", range(len(DIMS)))
@pytest.mark.parametrize("shape", [(3, 7, 5), (2, 13, 17), (1, 1, 2)])
def test_formula_matches_flop_counter(arch, dims, shape):
    dictionary = make_dictionary(41)
    model = build_model(arch, dictionary, DIMS[dims], seed=1)
    sample = _full_batch(dictionary, *shape, seed=sum(shape))
    counted, log = _counted(model, sample)
    formula = TransformerFlops.of_model(model)
    net = sample["net_input"]
    want = float(formula.of_lengths(net["src_lengths"], sample["target"].ne(1).sum(1)))
    assert counted > 0
    assert abs(want - counted) <= 5e-3 * counted, (want, counted)
    assert float(log["ls_flops"]) == pytest.approx(want, rel=1e-12)


def test_formula_counts_real_tokens_only():
    """A padded batch: the formula's FLOPs are those of the same sentences without padding."""
    dictionary = make_dictionary(41)
    model = build_model("ls_transformer", dictionary, DIMS[0], seed=1)
    formula = TransformerFlops.of_model(model)
    src_lengths, tgt_lengths = torch.tensor([7, 3, 1]), torch.tensor([2, 9, 4])
    whole = float(formula.of_lengths(src_lengths, tgt_lengths))
    parts = sum(float(formula.of_lengths(src_lengths[i:i + 1], tgt_lengths[i:i + 1]))
                for i in range(3))
    assert whole == pytest.approx(parts, rel=1e-12)
    counted = 0
    for i in range(3):  # each sentence alone has no padding: the counter's figure is exact
        sample = _full_batch(dictionary, 1, int(src_lengths[i]), int(tgt_lengths[i]), seed=i)
        counted += _counted(model, sample)[0]
    assert abs(whole - counted) <= 5e-3 * counted


def test_logged_only_in_training():
    dictionary = make_dictionary(41)
    model = build_model("ls_transformer", dictionary, DIMS[0], seed=1)
    criterion = LSLabelSmoothedCrossEntropyCriterion(DummyTask(dictionary), sentence_avg=False,
                                                     label_smoothing=0.1)
    model.eval()
    with torch.no_grad():
        _, _, log = criterion(model, _full_batch(dictionary, 2, 5, 4, seed=0))
    assert "ls_flops" not in log


@pytest.mark.parametrize("name,peak", [
    ("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H200", 989.4),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("Some Future GPU", None)])
def test_peak_by_device_name(name, peak):
    assert peak_tflops(name) == peak
