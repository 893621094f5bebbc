"""``--ls-shape-buckets``: the grid, the choice of padded shapes, and the padding's math (CPU).

The oracle for the padding is fairseq itself: fairseq's ``transformer`` and its
``label_smoothed_cross_entropy`` on a padded batch give the loss, nll_loss and every parameter
gradient of the unpadded batch (dropout 0). Tolerance: relative 1e-5 (fp32 sums over differently
shaped tensors; the padded positions and rows add exact zeros, so only the order of the sums
changes), and the same through the ls_ criterion and model. The logged counts must be equal.
"""
import logging
from types import SimpleNamespace

import pytest
import torch
from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterion

from fairseq_helpers import build_model, grad_err, make_dictionary, max_rel_err, random_batch
from ls_fairseq.criterions.ls_label_smoothed_cross_entropy import (
    LSLabelSmoothedCrossEntropyCriterion,
)
from ls_fairseq.graphs import shape_buckets
from ls_fairseq.graphs.shape_buckets import ShapeBuckets, bucket, token_slots

TINY = ["--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "16",
        "--encoder-ffn-embed-dim", "24", "--encoder-attention-heads", "2",
        "--decoder-attention-heads", "2", "--dropout", "0", "--share-all-embeddings"]


@pytest.fixture(scope="module")
def dictionary():
    return make_dictionary(53)


class TranslationLikeTask:
    """What the criterion reads of fairseq's translation task: dictionaries and padding sides."""

    def __init__(self, dictionary, left_pad_source=True, left_pad_target=False):
        self.source_dictionary = self.target_dictionary = dictionary
        self.cfg = SimpleNamespace(left_pad_source=left_pad_source,
                                   left_pad_target=left_pad_target)


# -- the grid --------------------------------------------------------------------------------

@pytest.mark.parametrize("steps", [1, 2, 3, 4, 7, 8, 16, 32])
def test_bucket_is_the_next_grid_point(steps):
    """The grid: every n <= steps, then multiples of 2**k / steps in [2**k, 2**(k+1))."""
    grid = set(range(1, steps + 1))
    for k in range(13):
        step = max(1, (1 << k) // steps)
        grid.update(range(1 << k, 1 << (k + 1), step))
    grid = sorted(grid)
    for n in range(1, 3000):
        b = bucket(n, steps)
        assert b == next(g for g in grid if g >= n), (n, steps)
        assert n <= b < n * (1 + 1 / steps) + 1e-9 or b == n, (n, steps, b)
        assert bucket(b, steps) == b


def test_bucket_zero_steps_is_the_identity():
    assert [bucket(n, 0) for n in range(1, 200)] == list(range(1, 200))


# -- the choice of shapes ----------------------------------------------------------------------

def test_shape_for_reuses_the_cheapest_earlier_shape_within_the_slack():
    sb = ShapeBuckets(16, 0.2)
    assert sb.shape_for((64, 30, 33)) == (64, 30, 34)  # 33 -> step 2 on [32, 64)
    assert sb.shape_for((56, 30, 33)) == (64, 30, 34)  # 1.16x its own slots: reused
    assert sb.shape_for((48, 29, 31)) == (48, 29, 31)  # 1.42x: its own grid shape
    assert sb.shape_for((40, 30, 30)) == (40, 30, 30)
    assert sb.shape_for((36, 32, 32)) == (36, 32, 32)
    assert sb.shape_for((35, 29, 29)) == (36, 32, 32)  # 1.14x, and (40, 30, 30) 1.18x
    assert sb.shape_for((72, 20, 20)) == (72, 20, 20)  # more rows than any: its own
    assert sb.shapes == [(64, 30, 34), (48, 29, 31), (40, 30, 30), (36, 32, 32), (72, 20, 20)]
    assert ShapeBuckets(16, 0.0).shape_for((56, 30, 33)) == (56, 30, 34)


def test_shape_for_holds_the_batch_and_bounds_the_cost():
    g = torch.Generator().manual_seed(0)
    for steps, slack in [(16, 0.2), (8, 0.0), (4, 0.5), (2, 0.1)]:
        sb = ShapeBuckets(steps, slack)
        for _ in range(3000):
            shape = tuple(int(x) for x in torch.randint(1, 300, (3,), generator=g))
            padded = sb.shape_for(shape)
            grid = tuple(bucket(n, steps) for n in shape)
            assert all(p >= s for p, s in zip(padded, shape)), (shape, padded)
            assert padded in sb.shapes
            assert padded == grid or token_slots(padded) <= (1 + slack) * token_slots(shape)
        assert len(set(sb.shapes)) == len(sb.shapes)


@pytest.mark.parametrize("steps", [4, 8, 16, 32])
@pytest.mark.parametrize("multiple", [2, 8, 64])
def test_grid_keeps_power_of_two_length_multiples(steps, multiple):
    """fairseq's --required-seq-len-multiple pads lengths to a multiple (for tensor cores). The
    grid's steps are powers of two (--ls-shape-buckets must be one), so a length that is a
    multiple of a power of two stays one, and every padded shape is a grid shape."""
    for n in range(multiple, 3000, multiple):
        assert bucket(n, steps) % multiple == 0, (n, steps, multiple)


@pytest.mark.parametrize("steps,slack,flag", [(-1, 0.2, "--ls-shape-buckets"),
                                              (12, 0.2, "--ls-shape-buckets .* power of two"),
                                              (16, -0.1, "--ls-shape-bucket-slack")])
def test_bad_flags_name_themselves(dictionary, steps, slack, flag):
    with pytest.raises(ValueError, match=flag):
        LSLabelSmoothedCrossEntropyCriterion(TranslationLikeTask(dictionary), False, 0.1,
                                             ls_cuda_graphs=True, ls_shape_buckets=steps,
                                             ls_shape_bucket_slack=slack)


# -- the padding keeps the math ------------------------------------------------------------------

def _sample(dictionary, shape, seed, left_pad_source=True):
    src, src_lengths, prev, tgt = random_batch(dictionary, *shape,
                                               generator=torch.Generator().manual_seed(seed),
                                               left_pad_source=left_pad_source)
    return {"net_input": {"src_tokens": src, "src_lengths": src_lengths,
                          "prev_output_tokens": prev},
            "target": tgt, "ntokens": int(tgt.ne(dictionary.pad()).sum())}


def _loss_and_grads(criterion, model, sample):
    model.zero_grad()
    loss, sample_size, log = criterion(model, sample)
    loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), log, grads


@pytest.mark.parametrize("left_pad_source", [True, False])
@pytest.mark.parametrize("shape,padded", [((5, 17, 19), (6, 24, 24)), ((3, 7, 5), (7, 9, 31)),
                                          ((4, 1, 2), (4, 1, 3))])
def test_fairseq_transformer_gives_the_same_loss_and_gradients(dictionary, left_pad_source,
                                                                shape, padded):
    """The oracle: fairseq's own model and criterion on the padded batch."""
    tokens = shape_buckets.Tokens(dictionary.pad(), dictionary.eos(), dictionary.pad(),
                                  dictionary.eos(), left_pad_source)
    model = build_model("transformer", dictionary, TINY, seed=1).train()
    criterion = LabelSmoothedCrossEntropyCriterion(TranslationLikeTask(dictionary), False, 0.1)
    sample = _sample(dictionary, shape, sum(shape), left_pad_source)
    big = shape_buckets.pad_batch(sample, padded, tokens)
    assert shape_buckets.batch_shape(big) == padded
    assert shape_buckets.batch_shape(sample) == shape  # not changed in place
    loss, log, grads = _loss_and_grads(criterion, model, sample)
    loss_p, log_p, grads_p = _loss_and_grads(criterion, model, big)
    assert torch.isfinite(loss_p)
    assert max_rel_err(loss_p, loss) <= 1e-5
    assert max_rel_err(log_p["nll_loss"], log["nll_loss"]) <= 1e-5
    assert grads.keys() == grads_p.keys()
    for k in grads:
        assert grad_err(k, grads_p[k], grads) <= 1e-5, k


def test_dummy_rows_and_columns(dictionary):
    pad, eos = dictionary.pad(), dictionary.eos()
    tokens = shape_buckets.Tokens(pad, eos, pad, eos, True)
    sample = _sample(dictionary, (2, 3, 4), 0)
    big = shape_buckets.pad_batch(sample, (4, 5, 6), tokens)
    src, prev = big["net_input"]["src_tokens"], big["net_input"]["prev_output_tokens"]
    assert torch.equal(src[:2, 2:], sample["net_input"]["src_tokens"])  # left-padded source
    assert (src[:2, :2] == pad).all() and (src[2:, :-1] == pad).all() and (src[2:, -1] == eos).all()
    assert torch.equal(prev[:2, :4], sample["net_input"]["prev_output_tokens"])
    assert (prev[2:, 0] == eos).all() and (prev[2:, 1:] == pad).all()
    assert (prev[:2, 4:] == pad).all()
    assert torch.equal(big["target"][:2, :4], sample["target"]) and (big["target"][2:] == pad).all()
    lengths = sample["net_input"]["src_lengths"].tolist()
    assert big["net_input"]["src_lengths"].tolist() == lengths + [1, 1]
    assert big["ntokens"] == sample["ntokens"]


@pytest.mark.parametrize("left_pad_source", [True, False])
def test_ls_criterion_pads_training_batches_only_and_logs_the_unpadded_batch(
        dictionary, left_pad_source, caplog):
    """Through the ls_ criterion and the ls_ model: the padded run equals the
    --ls-shape-buckets 0 run; the model saw the padded shapes. (On the CPU the graphs step aside
    and nothing is padded; here they are told they apply, and their calls then run eagerly on
    the CPU batches: the padding is what is tested.)"""
    task = TranslationLikeTask(dictionary, left_pad_source)
    model = build_model("ls_transformer", dictionary, TINY, seed=2).train()
    seen = []
    model.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(tuple(kwargs["src_tokens"].shape)), with_kwargs=True)
    plain = LSLabelSmoothedCrossEntropyCriterion(task, False, 0.1, report_accuracy=True,
                                                 ls_cuda_graphs=True, ls_shape_buckets=0)
    padded = LSLabelSmoothedCrossEntropyCriterion(task, False, 0.1, report_accuracy=True,
                                                  ls_cuda_graphs=True, ls_shape_buckets=2,
                                                  ls_shape_bucket_slack=0.5)
    for crit in (plain, padded):
        crit.graphs.applies = lambda model, sample: True
    for i, shape in enumerate([(5, 17, 19), (7, 9, 11), (5, 20, 22)]):
        sample = _sample(dictionary, shape, i, left_pad_source)
        loss, log, grads = _loss_and_grads(plain, model, sample)
        loss_p, log_p, grads_p = _loss_and_grads(padded, model, sample)
        assert max_rel_err(loss_p, loss) <= 1e-5
        for k in ("ntokens", "nsentences", "sample_size", "n_correct", "total"):
            assert int(log_p[k]) == int(log[k]), k
        for k in grads:
            assert grad_err(k, grads_p[k], grads) <= 1e-5, k
    # (5, 20, 22) reuses (6, 24, 24), the padded shape of (5, 17, 19): 1.37x its slots
    assert seen == [(5, 17), (6, 24), (7, 9), (8, 12), (5, 20), (6, 24)]
    model.eval()
    with torch.no_grad():
        padded(model, _sample(dictionary, (5, 17, 19), 0))
    assert seen[-1] == (5, 17)  # validation batches run at their own shape


def test_not_padded_without_the_tasks_padding_sides(dictionary, caplog):
    """A task that does not say how it pads (or left-pads targets): one warning, no padding."""
    for task in (SimpleNamespace(source_dictionary=dictionary, target_dictionary=dictionary),
                 TranslationLikeTask(dictionary, left_pad_target=True)):
        with caplog.at_level(logging.WARNING):
            crit = LSLabelSmoothedCrossEntropyCriterion(task, False, 0.1, ls_cuda_graphs=True)
        assert crit.shape_buckets is None
        assert "--ls-shape-buckets: batches are not padded" in caplog.text
        caplog.clear()
    assert LSLabelSmoothedCrossEntropyCriterion(TranslationLikeTask(dictionary), False, 0.1,
                                                ls_no_cuda_graphs=True).shape_buckets is None
    assert LSLabelSmoothedCrossEntropyCriterion(TranslationLikeTask(dictionary), False,
                                                0.1).shape_buckets is not None  # the default
