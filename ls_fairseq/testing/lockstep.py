"""How closely a run with ls_ parts must follow fairseq's, update by update, in logged grad norm
(the GPU lockstep tests, ``tests/gpu/test_training_parity_cuda.py``).

The grad norm is the most sensitive figure fairseq logs. Two runs whose gradients differ by
rounding only (the ls_ criterion's fp16 logit gradient, ls_adam's fused update) log the same grad
norm while the learning rate warms up, and then, at the peak learning rate, drift apart in both
directions while their losses still agree to 0.002. Measured on an H200 (torch 2.11,
``scripts/parity_gnorm.py``, rows in ``tests/data/parity_gnorm_h200.json``): fairseq against
itself bitwise equal; within the 40 warm-up updates every arm within 0.1%; after them, the ls_
criterion alone up to 1.5%, ls_adam alone 0.6%, both 2.0%, signs alternating, mean over the run
-0.03%. So:

* per update, within ``WARMUP_TOL`` while the learning rate warms up and ``PEAK_TOL`` after;
* over the run, the mean signed difference within ``BIAS_TOL``: a systematic error (a gradient
  scaled by 0.5%, a step that is slightly too long) shows there, rounding does not.
"""
from typing import Iterable, Mapping, Optional, Tuple

WARMUP_TOL = 0.01
PEAK_TOL = 0.03
BIAS_TOL = 0.002

Row = Mapping[str, object]  # one logged update (fairseq's train_inner json)


def gnorm_difference(ref: Row, other: Row) -> float:
    """The other run's logged grad norm relative to fairseq's, minus one (signed)."""
    return float(other["gnorm"]) / float(ref["gnorm"]) - 1


def assert_gnorms_follow(pairs: Iterable[Tuple[int, Row, Row]], warmup_updates: int,
                         warmup_tol: float = WARMUP_TOL, peak_tol: float = PEAK_TOL,
                         bias_tol: Optional[float] = BIAS_TOL) -> float:
    """``pairs``: (update number, fairseq's row, the other run's row) of the updates compared.
    Raises AssertionError naming the first update outside its bound, or the bias (unless
    ``bias_tol`` is None); returns the mean signed difference (:func:`gnorm_difference`)."""
    differences = []
    for update, ref, other in pairs:
        difference = gnorm_difference(ref, other)
        bound = warmup_tol if update <= warmup_updates else peak_tol
        assert abs(difference) <= bound, (
            f"update {update}: grad norm {other['gnorm']} against fairseq's {ref['gnorm']} "
            f"({difference:+.2%}, bound {bound:.0%})", ref, other)
        differences.append(difference)
    assert differences, "no update compared"
    bias = sum(differences) / len(differences)
    if bias_tol is not None:
        assert abs(bias) <= bias_tol, (
            f"grad norm {bias:+.3%} from fairseq's on average over {len(differences)} updates "
            f"(bound {bias_tol:.1%}): a systematic difference, not rounding")
    return bias
