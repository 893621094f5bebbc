"""The additive padding bias the efficient attention kernel reads (``_attention_cuda._padding_bias``;
plain torch, so it runs on the CPU).

It is built once per key-padding-mask tensor and dtype and kept on the mask, so the 12 attentions
that share the encoder's mask build it once. What must hold: every call sees the mask's current
content (rebuilt after an in-place change), each mask object has its own, and the values are
0 / -inf exactly where the mask says keep / pad.
"""
import pytest
import torch

from ls_fairseq.ops import _attention_cuda as ac


def _mask(b=3, tk=21, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, tk + 1, (b,), generator=g)
    return torch.arange(tk)[None, :] >= lengths[:, None]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tk", [1, 16, 21, 37])
def test_values_and_alignment(dtype, tk):
    mask = _mask(tk=tk)
    bias = ac._padding_bias(mask, 4, 5, dtype)
    assert bias.shape == (3, 4, 5, tk) and bias.dtype == dtype
    expected = torch.zeros(3, tk, dtype=dtype).masked_fill(mask, float("-inf"))
    assert torch.equal(bias, expected[:, None, None, :].expand(3, 4, 5, tk))
    assert bias.stride(0) % 16 == 0 and bias.stride(1) == bias.stride(2) == 0


def test_built_once_per_mask_and_dtype():
    mask = _mask()
    self_attn = ac._padding_bias(mask, 4, 21, torch.float16)
    cross = ac._padding_bias(mask, 4, 9, torch.float16)  # other query length, same rows
    assert cross.data_ptr() == self_attn.data_ptr()
    other_dtype = ac._padding_bias(mask, 4, 21, torch.float32)
    assert other_dtype.data_ptr() != self_attn.data_ptr()
    same_content = _mask()  # an equal mask that is another tensor gets its own rows
    assert torch.equal(same_content, mask)
    assert ac._padding_bias(same_content, 4, 21, torch.float16).data_ptr() != self_attn.data_ptr()


def test_rebuilt_after_the_mask_changes_in_place():
    mask = _mask()
    before = ac._padding_bias(mask, 2, 3, torch.float16).clone()
    mask[:, 0] = ~mask[:, 0]
    after = ac._padding_bias(mask, 2, 3, torch.float16)
    assert not torch.equal(after, before)
    expected = torch.zeros(mask.shape, dtype=torch.float16).masked_fill(mask, float("-inf"))
    assert torch.equal(after[:, 0, 0], expected)
    # a change through a view of the mask counts too (shared version counter)
    mask[1:].fill_(True)
    assert torch.isinf(ac._padding_bias(mask, 2, 3, torch.float16)[1:]).all()
