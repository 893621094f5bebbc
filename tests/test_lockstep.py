"""``ls_fairseq.testing.lockstep.assert_gnorms_follow``, the grad-norm check of the GPU lockstep
tests, replayed on recorded runs (``tests/data/parity_gnorm_h200.json``, written by
``scripts/parity_gnorm.py`` on an H200): the measured ls_ arms pass; the same runs with a
systematic error, or one update too far off, fail."""
import json
import pathlib

import pytest

from ls_fairseq.testing.lockstep import BIAS_TOL, PEAK_TOL, WARMUP_TOL, assert_gnorms_follow

RECORDED = json.loads((pathlib.Path(__file__).parent / "data" / "parity_gnorm_h200.json")
                      .read_text())
RUNS = RECORDED["runs"]
WARMUP = RECORDED["warmup_updates"]  # the recipe's --warmup-updates


def _pairs(name, scale=1.0, at=None, by=1.0):
    """(update, fairseq's row, ``name``'s row) with ``name``'s grad norm times ``scale``, and at
    update ``at`` times ``by`` as well."""
    ref, other = RUNS["fairseq"], RUNS[name]
    out = []
    for u in sorted(map(int, ref)):
        row = dict(other[str(u)])
        row["gnorm"] = float(row["gnorm"]) * scale * (by if u == at else 1.0)
        out.append((u, ref[str(u)], row))
    return out


@pytest.mark.parametrize("name", ["crit_only", "adam_only", "ls_parts"])
def test_the_measured_arms_pass(name):
    bias = assert_gnorms_follow(_pairs(name), WARMUP)
    assert abs(bias) < BIAS_TOL / 2  # measured: |bias| <= 0.05%


def test_the_old_one_percent_everywhere_fails_the_measured_run():
    """Why the bound after warm-up is wider: the ls_ criterion alone crosses 1% there."""
    with pytest.raises(AssertionError, match="update 50"):
        assert_gnorms_follow(_pairs("crit_only"), WARMUP, peak_tol=WARMUP_TOL)


@pytest.mark.parametrize("scale", [1.005, 0.995])
def test_a_systematic_half_percent_fails(scale):
    """Within every per-update bound, but biased: caught by the mean."""
    with pytest.raises(AssertionError, match="systematic"):
        assert_gnorms_follow(_pairs("ls_parts", scale=scale), WARMUP)


@pytest.mark.parametrize("at,by,bound", [(20, 1.015, WARMUP_TOL), (55, 1.04, PEAK_TOL)])
def test_one_update_too_far_off_fails(at, by, bound):
    with pytest.raises(AssertionError, match=f"update {at}: .*bound {bound:.0%}"):
        assert_gnorms_follow(_pairs("ls_parts", at=at, by=by), WARMUP)


def test_bias_unchecked_when_not_asked():
    assert_gnorms_follow(_pairs("ls_parts", scale=1.005), WARMUP, bias_tol=None)


def test_nothing_compared_fails():
    with pytest.raises(AssertionError, match="no update"):
        assert_gnorms_follow([], WARMUP)
