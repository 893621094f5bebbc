"""The fixed-shape beam search (ls_fairseq/generation) on the GPU, with the CUDA kernels.

* graphs vs eager steps of the same padded shapes (``LS_FAIRSEQ_GENERATOR=eager`` with
  ``PAD_EAGER``): the same kernels on the same buffers, so the same hypotheses and scores bit for
  bit, fp16 and bf16, over several batches of one shape (graph replays across batches), a longer
  batch (more capacity, new graphs) and batches that shrink (fairseq's batch reduction, in powers
  of two; ``SHRINK`` 2 here so that it happens often);
* fp32 (no graphs: exact lengths) against fairseq's SequenceGenerator running fairseq's
  transformer with the same weights: identical tokens, scores within 1e-4 relative (the two
  models' fp32 kernels differ: ls_fairseq's fused sublayer kernels against fairseq's modules;
  CPU: 1e-5, tests/test_fast_generation.py). Each low-precision test casts a copy of the models:
  casting the shared fixture in place and back rounded its weights for the tests after it;
* fp16 against fairseq: >= 90% identical best hypotheses (the two round at different points, and
  the graphs attend over padded shapes: near-ties flip), every hypothesis ends in eos, none longer
  than max_len + 1;
* the graph path captured graphs and replayed them (counts, not timings);
* captures succeed while another thread pins memory (fairseq's data loader does), and a capture
  that fails anyway falls back to eager steps with the same results.
"""
import copy

import pytest
import torch
from fairseq.sequence_generator import SequenceGenerator

from fairseq_helpers import build_pair, make_dictionary, random_batch
from ls_fairseq.generation import LSSequenceGenerator, generator as fast

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernels_required")]

SMALL = ["--encoder-layers", "3", "--decoder-layers", "3", "--encoder-embed-dim", "128",
         "--decoder-embed-dim", "128", "--encoder-ffn-embed-dim", "256",
         "--decoder-ffn-embed-dim", "256", "--encoder-attention-heads", "4",
         "--decoder-attention-heads", "4", "--dropout", "0.0", "--share-all-embeddings"]


@pytest.fixture(scope="module")
def setup(extension):
    d = make_dictionary(203)
    ref, ls = build_pair("transformer_wmt_en_de_big_t2t", d, SMALL, seed=3)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
        # eos likelier: sentences finish at different steps
        ref.decoder.output_projection.weight[d.eos()] *= 3.0
    ls.load_state_dict(ref.state_dict())
    return d, ref.cuda().eval(), ls.cuda().eval()


def _batches(d, sizes, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for bsz, src_len in sizes:
        src, lengths, _, _ = random_batch(d, bsz, src_len, 1, g)
        out.append({"net_input": {"src_tokens": src.cuda(), "src_lengths": lengths.cuda()}})
    return out


def _run(gen_cls, model, d, batches, beam, **opts):
    gen = gen_cls([model], d, beam_size=beam, **opts)
    return gen, [gen.generate([model], b) for b in batches]


def _flat(results):
    return [h for hyps in results for sent in hyps for h in sent]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("beam", [1, 5])
def test_graphs_equal_eager(setup, dtype, beam, monkeypatch):
    d, _, ls = setup
    monkeypatch.setattr(fast, "SHRINK", 2)
    model = copy.deepcopy(ls).to(dtype)  # the fixture's fp32 weights stay unrounded
    batches = _batches(d, [(8, 13), (8, 11), (33, 14), (8, 29), (3, 7)], seed=beam)
    gen, graphed = _run(LSSequenceGenerator, model, d, batches, beam, max_len_b=40)
    monkeypatch.setenv(fast.ENV, "eager")
    monkeypatch.setattr(fast, "PAD_EAGER", True)
    eager_gen, eager = _run(LSSequenceGenerator, model, d, batches, beam, max_len_b=40)
    a, b = _flat(graphed), _flat(eager)
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert torch.equal(x["tokens"], y["tokens"])
        assert torch.equal(x["score"], y["score"])
        assert torch.equal(x["positional_scores"], y["positional_scores"])
    print(gen.stats)
    assert gen.stats["captures"] >= 2 and gen.stats["replays"] > gen.stats["captures"]
    assert gen.stats["shrinks"] >= 1
    assert eager_gen.stats["captures"] == 0


def test_fp32_matches_fairseq(setup):
    d, ref, ls = setup
    torch.backends.cuda.matmul.allow_tf32 = False
    batches = _batches(d, [(8, 13), (5, 21)], seed=11)
    gen, ours = _run(LSSequenceGenerator, ls, d, batches, 5, max_len_b=40)
    _, theirs = _run(SequenceGenerator, ref, d, batches, 5, max_len_b=40)
    assert gen.stats["steps"] > 0 and gen.stats["captures"] == 0  # fp32: eager, exact shapes
    worst = 0.0
    for x, y in zip(ours, theirs):
        for s1, s2 in zip(x, y):
            assert len(s1) == len(s2)
            for h1, h2 in zip(s1, s2):
                assert torch.equal(h1["tokens"], h2["tokens"])
                a, b = float(h1["score"]), float(h2["score"])
                worst = max(worst, abs(a - b) / abs(b))
    print(f"fp32: largest relative score difference {worst:.2e}")
    assert worst <= 1e-4


def test_fp16_matches_fairseq(setup):
    d, ref, ls = setup
    batches = _batches(d, [(16, 13), (16, 24), (7, 9)], seed=5)
    _, ours = _run(LSSequenceGenerator, copy.deepcopy(ls).half(), d, batches, 4, max_len_b=30)
    _, theirs = _run(SequenceGenerator, copy.deepcopy(ref).half(), d, batches, 4, max_len_b=30)
    best = [(x[0]["tokens"], y[0]["tokens"]) for r1, r2 in zip(ours, theirs)
            for x, y in zip(r1, r2)]
    same = sum(torch.equal(a, b) for a, b in best)
    print(f"fp16: {same}/{len(best)} identical best hypotheses")
    assert same >= 0.9 * len(best)
    for h in _flat(ours):
        assert h["tokens"][-1].item() == d.eos() and len(h["tokens"]) <= 31


def test_captures_survive_pinning_on_another_thread(setup):
    """fairseq's data loader pins each batch (cudaHostAlloc) on its own thread while
    fairseq-generate decodes. Under the default (global) capture mode such a call breaks a capture
    in progress: the fairseq-generate runs of the benchmark failed at capture_end, at random, with
    cudaErrorStreamCaptureInvalidated. Captures are thread-local: they must all succeed while
    another thread pins memory as fast as it can."""
    import threading

    d, _, ls = setup
    model = copy.deepcopy(ls).half()
    stop = threading.Event()

    def pin():
        while not stop.is_set():
            torch.empty(1 << 16, pin_memory=True)

    thread = threading.Thread(target=pin, daemon=True)
    thread.start()
    try:
        gen, results = _run(LSSequenceGenerator, model, d,
                            _batches(d, [(8, 13), (16, 29), (5, 7), (33, 14)], seed=4), 5,
                            max_len_b=40)
    finally:
        stop.set()
        thread.join()
    assert gen.stats["captures"] >= 4
    assert gen.stats["capture_failures"] == 0
    assert _flat(results)


def test_failed_capture_falls_back_to_eager(setup, monkeypatch, caplog):
    """A capture that fails anyway is dropped: the steps of its shape run eagerly (one warning),
    and the hypotheses are those of all-eager decoding bit for bit."""
    d, _, ls = setup
    model = copy.deepcopy(ls).half()
    batches = _batches(d, [(8, 13), (8, 11), (8, 29)], seed=6)
    real_end = torch.cuda.CUDAGraph.capture_end
    failures = {"left": 3}

    def failing_end(graph):
        real_end(graph)
        if failures["left"] > 0:
            failures["left"] -= 1
            raise RuntimeError("CUDA error: operation failed due to a previous error during "
                               "capture (simulated)")

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_end", failing_end)
    with caplog.at_level("WARNING"):
        gen, graphed = _run(LSSequenceGenerator, model, d, batches, 5, max_len_b=40)
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_end", real_end)
    assert failures["left"] == 0
    # the generator's count: workspaces replaced since (a larger source) took their shapes along
    assert gen.stats["capture_failures"] == 3
    assert gen.stats["captures"] >= 1  # the later shapes were captured
    assert sum("could not be captured" in r.getMessage() for r in caplog.records) == 1
    monkeypatch.setenv(fast.ENV, "eager")
    monkeypatch.setattr(fast, "PAD_EAGER", True)
    _, eager = _run(LSSequenceGenerator, model, d, batches, 5, max_len_b=40)
    a, b = _flat(graphed), _flat(eager)
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert torch.equal(x["tokens"], y["tokens"]) and torch.equal(x["score"], y["score"])
