"""The GPU tests' Philox4x32-10 oracle (ls_fairseq/testing/kernel_oracle.py) against Random123's
published known-answer vectors: CPU arithmetic, so it runs in CI."""
import torch

from ls_fairseq.testing.kernel_oracle import M32, philox4x32_10


def test_philox_oracle_known_answers():
    # Random123 known-answer vectors for Philox4x32-10
    cases = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((M32, M32, M32, M32), (M32, M32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
         (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    ]
    for ctr, key, expected in cases:
        c = [torch.tensor([v], dtype=torch.int64) for v in ctr]
        out = philox4x32_10(*c, key[0], key[1])
        assert tuple(int(o) for o in out) == expected
