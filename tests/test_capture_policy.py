"""``--ls-cuda-graphs-capture``: when a batch shape without graphs is captured (``CapturePolicy``)
and which policy the criterion picks. The captures and replays themselves run on the GPU
(tests/gpu/test_cuda_graphs_cuda.py, ``test_first_sighting_captures_match_eager``)."""
import random

import pytest

from fairseq_helpers import DummyTask, make_dictionary  # noqa: E402
from test_shape_buckets import TranslationLikeTask  # noqa: E402
from ls_fairseq.criterions.ls_label_smoothed_cross_entropy import (  # noqa: E402
    LSLabelSmoothedCrossEntropyCriterion,
)
from ls_fairseq.graphs.capture_policy import CapturePolicy  # noqa: E402

SIG = ("model", ("prev_output_tokens", "src_lengths", "src_tokens"), False, "ranks, dtypes")


def _shapes(rows, src_len, tgt_len):
    """The key's shapes as CudaGraphedLoss makes them: net_input by name, then target."""
    return (rows, tgt_len), (rows,), (rows, src_len), (rows, tgt_len)


def test_second_sighting_runs_every_first_sighting_eagerly():
    policy = CapturePolicy(first_sighting=False)
    for shape in [(8, 30, 30), (4, 10, 10), (4, 10, 10), (8, 30, 30)]:
        decided = policy.capture(SIG, _shapes(*shape))
        policy.ran(SIG, _shapes(*shape))
        assert decided == (policy.sightings[SIG, _shapes(*shape)] == 2), shape


def test_first_sighting_captures_what_fits_in_the_largest_run_so_far():
    policy = CapturePolicy(first_sighting=True)
    steps = [((8, 30, 20), False),   # nothing ran yet: eager
             ((4, 10, 10), True),    # smaller in every dimension
             ((8, 30, 20), True),    # its second sighting
             ((9, 12, 12), False),   # more rows than any step so far
             ((9, 12, 12), True),    # second sighting
             ((9, 30, 20), True),    # rows from one step, lengths from another: nothing grows
             ((2, 31, 5), False),    # a longer source
             ((2, 5, 21), False),    # a longer target
             ((9, 31, 21), True)]
    for shape, want in steps:
        assert policy.capture(SIG, _shapes(*shape)) == want, shape
        policy.ran(SIG, _shapes(*shape))
    other = SIG[:-1] + ("other dtypes",)  # another signature has its own largest shapes
    assert not policy.capture(other, _shapes(1, 2, 3))


def test_first_sighting_matches_its_definition_on_random_streams():
    """Against the definition written out: a shape is captured at its first sighting iff a step
    ran before and no dimension exceeds the maximum of that dimension over the steps run."""
    rng = random.Random(0)
    for _ in range(20):
        policy, run, seen = CapturePolicy(first_sighting=True), [], set()
        for _ in range(200):
            shape = _shapes(rng.randint(1, 12), rng.randint(1, 40), rng.randint(1, 40))
            first = shape not in seen
            want = (not first) or (bool(run) and all(
                n <= max(r[i][j] for r in run)
                for i, dims in enumerate(shape) for j, n in enumerate(dims)))
            assert policy.capture(SIG, shape) == want
            seen.add(shape)
            run.append(shape)
            policy.ran(SIG, shape)


def _criterion(task, **kw):
    return LSLabelSmoothedCrossEntropyCriterion(task, sentence_avg=False, label_smoothing=0.1,
                                                ls_cuda_graphs=True, **kw)


def test_auto_captures_at_first_sighting_only_when_batches_are_padded():
    dictionary = make_dictionary(50)
    padded = _criterion(TranslationLikeTask(dictionary))
    assert padded.shape_buckets is not None and padded.graphs.policy.first_sighting
    # no padding (--ls-shape-buckets 0, or a task the padding does not know): one-off shapes
    for crit in (_criterion(TranslationLikeTask(dictionary), ls_shape_buckets=0),
                 _criterion(DummyTask(dictionary))):
        assert crit.shape_buckets is None and not crit.graphs.policy.first_sighting
    for value, want in (("first-sighting", True), ("second-sighting", False)):
        for task in (TranslationLikeTask(dictionary), DummyTask(dictionary)):
            assert _criterion(task, ls_cuda_graphs_capture=value).graphs.policy.first_sighting \
                == want


def test_capture_flag_rejects_other_values():
    with pytest.raises(ValueError, match="--ls-cuda-graphs-capture must be auto, first-sighting"):
        _criterion(DummyTask(make_dictionary(50)), ls_cuda_graphs_capture="third")


def test_outgrown_positional_tables_stay_alive_and_agree_with_the_grown_one():
    """A sinusoidal table grown for a longer batch replaces the module's buffer; graphs captured
    before still read the old one, which must stay allocated and equal the new one's first rows
    (the GPU check: test_first_sighting_captures_match_eager, whose tables grow mid-test)."""
    import torch
    from fairseq_helpers import build_model

    dictionary = make_dictionary(50)
    model = build_model("ls_transformer", dictionary,
                        ["--encoder-layers", "1", "--decoder-layers", "1",
                         "--encoder-embed-dim", "16", "--encoder-ffn-embed-dim", "32",
                         "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
                         "--max-source-positions", "8", "--max-target-positions", "8"])
    encoder = model.encoder
    old = encoder.embed_positions.weights
    tokens = torch.full((2, 30), dictionary.nspecial)  # a non-special token everywhere
    encoder.embedding(tokens, encoder.embed_tokens, encoder.embed_positions)
    new = encoder.embed_positions.weights
    assert new.size(0) > old.size(0)
    assert len(encoder.embedding._outgrown) == 1 and encoder.embedding._outgrown[0] is old
    assert torch.equal(new[:old.size(0)], old)
