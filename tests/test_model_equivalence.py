"""ls_transformer vs fairseq's transformer with the same weights (CPU, fp32).

Tolerance: max|ls - fairseq| / max|fairseq| <= 1e-5 per tensor. Both models do the same fp32
arithmetic, but in differently shaped GEMMs (fused QKV, layer-batched cross K/V) whose summation
order differs; observed errors are ~1e-7, so 1e-5 leaves margin while still catching any wrong
mask, scale, LayerNorm placement or missing term (those give errors of order 1e-2 or more).
"""
import pytest
import torch

from fairseq_helpers import TINY, build_pair, grad_err, make_dictionary, max_rel_err, random_batch

TOL = 1e-5

CONFIGS = {
    "post_ln_shared": ("transformer", TINY + ["--share-all-embeddings"]),
    "pre_ln_t2t": ("transformer_wmt_en_de_big_t2t", TINY + ["--share-all-embeddings"]),
    "learned_pos_gelu": ("transformer_wmt_en_de_big", TINY + [
        "--encoder-learned-pos", "--decoder-learned-pos", "--activation-fn", "gelu",
        "--share-decoder-input-output-embed"]),
    "unshared_layernorm_embedding": ("transformer_iwslt_de_en", TINY + [
        "--layernorm-embedding", "--no-scale-embedding"]),
    "pre_ln_no_final_norm_odd_heads": ("transformer_vaswani_wmt_en_de_big", [
        "--encoder-layers", "1", "--decoder-layers", "2", "--encoder-embed-dim", "15",
        "--decoder-embed-dim", "15", "--encoder-ffn-embed-dim", "7",
        "--decoder-ffn-embed-dim", "9", "--encoder-attention-heads", "3",
        "--decoder-attention-heads", "5", "--dropout", "0", "--attention-dropout", "0",
        "--encoder-normalize-before", "--decoder-normalize-before", "--no-decoder-final-norm",
        "--activation-fn", "gelu_accurate"]),
}


@pytest.fixture(scope="module")
def dictionary():
    return make_dictionary(45)


def _perturb(model, g):
    """Fresh random weights around fairseq's init (biases and LayerNorm too), identical in both
    models once loaded; kept near the init scale so attention is not saturated, where gradients
    vanish into rounding noise and no comparison is meaningful."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def _pair(name, dictionary):
    arch, extra = CONFIGS[name]
    ref, ls = build_pair(arch, dictionary, extra, seed=1234)
    return ref, ls


@pytest.mark.parametrize("name", list(CONFIGS))
def test_same_state_dict_and_initial_weights(name, dictionary):
    ref, ls = _pair(name, dictionary)
    ref_sd, ls_sd = ref.state_dict(), ls.state_dict()
    assert list(ref_sd.keys()) == list(ls_sd.keys())
    for key in ref_sd:
        assert ref_sd[key].shape == ls_sd[key].shape, key
        # same --seed gives the same initial weights: parameters are created in fairseq's order
        assert torch.equal(ref_sd[key], ls_sd[key]), key
    ls.load_state_dict(ref_sd, strict=True)
    ref.load_state_dict(ls_sd, strict=True)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("shape", [(5, 9, 7), (3, 1, 4), (4, 13, 1)])
def test_forward_backward_match_fairseq(name, shape, dictionary):
    ref, ls = _pair(name, dictionary)
    g = torch.Generator().manual_seed(hash((name, shape)) % 2**31)
    _perturb(ref, g)
    ls.load_state_dict(ref.state_dict())
    ref.train()
    ls.train()
    bsz, src_len, tgt_len = shape
    src, src_lengths, prev, _ = random_batch(dictionary, bsz, src_len, tgt_len, g)

    ref_enc = ref.encoder(src, src_lengths=src_lengths)
    ls_enc = ls.encoder(src, src_lengths=src_lengths)
    assert max_rel_err(ls_enc["encoder_out"][0], ref_enc["encoder_out"][0]) <= TOL

    ref_out, _ = ref(src, src_lengths, prev)
    ls_out, _ = ls(src, src_lengths, prev)
    assert ls_out.shape == ref_out.shape
    assert max_rel_err(ls_out, ref_out) <= TOL

    upstream = torch.randn(ref_out.shape, generator=g)
    (ref_out * upstream).sum().backward()
    (ls_out * upstream).sum().backward()
    ls_params = dict(ls.named_parameters())
    ref_grads = {k: p.grad for k, p in ref.named_parameters() if p.grad is not None}
    for key, p in ref.named_parameters():
        q = ls_params[key]
        assert (p.grad is None) == (q.grad is None), key
        if p.grad is not None:
            err = grad_err(key, q.grad, ref_grads)
            assert err <= TOL, (key, err)


@pytest.mark.parametrize("name", ["post_ln_shared", "pre_ln_t2t", "learned_pos_gelu"])
def test_incremental_decoding_and_reorder_match_fairseq(name, dictionary):
    """Beam-search-like decoding: 3 sentences x beam 2, beams reordered within their sentence
    (cache sizes kept), then one finished sentence dropped (caches gathered)."""
    ref, ls = _pair(name, dictionary)
    g = torch.Generator().manual_seed(7)
    _perturb(ref, g)
    ls.load_state_dict(ref.state_dict())
    ref.eval()
    ls.eval()
    beam, steps = 2, 6
    src, src_lengths, _, _ = random_batch(dictionary, 3, 6, 2, g)
    src, src_lengths = src.repeat_interleave(beam, 0), src_lengths.repeat_interleave(beam, 0)
    prev = torch.randint(dictionary.nspecial, len(dictionary), (src.size(0), steps), generator=g)
    prev[:, 0] = dictionary.eos()
    reorders = {3: torch.tensor([1, 1, 2, 3, 5, 4]), 5: torch.tensor([0, 1, 4, 5])}
    with torch.no_grad():
        ref_enc = ref.encoder(src, src_lengths=src_lengths)
        ls_enc = ls.encoder(src, src_lengths=src_lengths)
        ref_state, ls_state = {}, {}
        for t in range(1, steps + 1):
            if t in reorders:
                order = reorders[t]
                ref.decoder.reorder_incremental_state_scripting(ref_state, order)
                ls.decoder.reorder_incremental_state_scripting(ls_state, order)
                ref_enc = ref.encoder.reorder_encoder_out(ref_enc, order)
                ls_enc = ls.encoder.reorder_encoder_out(ls_enc, order)
                prev = prev.index_select(0, order)
            ref_logits, ref_extra = ref.decoder(prev[:, :t], ref_enc, incremental_state=ref_state)
            ls_logits, ls_extra = ls.decoder(prev[:, :t], ls_enc, incremental_state=ls_state)
            assert ls_logits.shape == (prev.size(0), 1, len(dictionary))
            assert max_rel_err(ls_logits, ref_logits) <= TOL, t
            # cross-attention weights (used for alignments) match too
            assert max_rel_err(ls_extra["attn"][0], ref_extra["attn"][0]) <= TOL, t
        # the incremental result equals a full (teacher-forced) pass over the same prefix
        full, _ = ls.decoder(prev, ls_enc)
        assert max_rel_err(ls_logits[:, -1], full[:, -1]) <= TOL


def test_several_models_in_one_process_are_independent(dictionary):
    """No global/class-level state: two ls_ models with different weights, interleaved."""
    _, a = _pair("pre_ln_t2t", dictionary)
    ref_b, b = build_pair("transformer_wmt_en_de_big_t2t", dictionary,
                          CONFIGS["pre_ln_t2t"][1], seed=99)
    ref_a, _ = _pair("pre_ln_t2t", dictionary)
    g = torch.Generator().manual_seed(3)
    src, src_lengths, prev, _ = random_batch(dictionary, 3, 5, 4, g)
    for m in (a, b, ref_a, ref_b):
        m.eval()
    with torch.no_grad():
        out_a1, _ = a(src, src_lengths, prev)
        out_b, _ = b(src, src_lengths, prev)
        out_a2, _ = a(src, src_lengths, prev)
        assert torch.equal(out_a1, out_a2)
        assert max_rel_err(out_a1, ref_a(src, src_lengths, prev)[0]) <= TOL
        assert max_rel_err(out_b, ref_b(src, src_lengths, prev)[0]) <= TOL
        assert not torch.allclose(out_a1, out_b)


def test_unsupported_options_raise_clear_errors(dictionary):
    from fairseq_helpers import build_model

    with pytest.raises(ValueError, match="--encoder-layerdrop"):
        build_model("ls_transformer", dictionary, TINY + ["--encoder-layerdrop", "0.1"])
    with pytest.raises(ValueError, match="--cross-self-attention"):
        build_model("ls_transformer", dictionary, TINY + ["--cross-self-attention"])
    from ls_fairseq.ops.bias_act_dropout import check_activation

    with pytest.raises(ValueError, match="--activation-fn"):
        check_activation("nope")


def test_learned_positions_overflow_names_the_flag(dictionary):
    from fairseq_helpers import build_model

    model = build_model("ls_transformer", dictionary,
                        TINY + ["--encoder-learned-pos", "--max-source-positions", "8"])
    src = torch.full((1, 9), dictionary.index("w3"))
    with pytest.raises(ValueError, match="--max-source-positions"):
        model.encoder(src)


def test_set_num_updates_reaches_every_hook_once(dictionary):
    """The model's set_num_updates walks the modules once (fairseq's default walks the encoder
    twice) and still calls every submodule's own hook, as fairseq's does."""
    from fairseq.models import BaseFairseqModel

    class Hook(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.seen = []

        def set_num_updates(self, n):
            self.seen.append(n)

    results = []
    for walk in ("ls", "fairseq"):
        _, model = _pair("pre_ln_t2t", dictionary)
        hooks = [Hook(), Hook(), Hook()]
        model.encoder.extra_hook = hooks[0]
        model.decoder.layers[0].extra_hook = hooks[1]
        model.extra_hook = hooks[2]
        if walk == "ls":
            model.set_num_updates(17)
        else:
            BaseFairseqModel.set_num_updates(model, 17)
        results.append([h.seen for h in hooks])
    assert results[0] == [[17], [17], [17]]
    assert results[1] == [[17, 17], [17], [17]]  # fairseq: the encoder's subtree twice
