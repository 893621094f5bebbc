"""When a batch shape without graphs is captured rather than run eagerly
(``--ls-cuda-graphs-capture``): the engine's capture policy (``replay.CudaGraphedLoss`` asks it at
each sighting of a shape that has no graphs; ``bench/shape_buckets.py`` simulates it)."""
import collections

from .. import switches


CAPTURE_CHOICES = ("auto", "first-sighting", "second-sighting")  # --ls-cuda-graphs-capture


def captures_first_sighting(capture: str, padded: bool) -> bool:
    """``--ls-cuda-graphs-capture`` resolved: ``auto`` captures at the first sighting when the
    batches are padded to bucketed shapes (they recur), else at the second (one-off shapes would
    pay for a capture they never use)."""
    if capture not in CAPTURE_CHOICES:
        raise switches.Refused(f"--ls-cuda-graphs-capture must be "
                               f"{', '.join(CAPTURE_CHOICES[:-1])} or {CAPTURE_CHOICES[-1]}, "
                               f"got {capture!r}")
    return capture == "first-sighting" or (capture == "auto" and padded)


class CapturePolicy:
    """When a batch shape that has no graphs is captured rather than run eagerly.

    A shape's first sighting runs eagerly, so whatever the model grows lazily for larger inputs
    (fairseq's sinusoidal positional table, grown to the longest sequence seen) grows outside a
    capture; inside one it would land in the graphs' memory pool. Its second sighting is
    captured. With ``first_sighting``, a shape is captured at its first
    sighting too, unless some dimension of some input exceeds the largest run so far (of the
    same inputs, dtypes and ranks): then nothing can need growing. In a shuffled epoch that
    leaves a few dozen eager steps (each dimension's running maximum rises ~log(n) times).
    Used by ``bench/shape_buckets.py`` as well."""

    def __init__(self, first_sighting: bool = False):
        self.first_sighting = first_sighting
        self.sightings = collections.Counter()
        self.largest = {}  # signature -> per input, the largest size of each dimension run

    def capture(self, signature, shapes) -> bool:
        """Counts a sighting of (signature, shapes), a shape without graphs; True: capture it."""
        self.sightings[signature, shapes] += 1
        if self.sightings[signature, shapes] >= 2:
            return True
        largest = self.largest.get(signature)
        return self.first_sighting and largest is not None and all(
            n <= m for shape, top in zip(shapes, largest) for n, m in zip(shape, top))

    def ran(self, signature, shapes):
        """A step of these shapes ran (eagerly or captured)."""
        largest = self.largest.get(signature)
        self.largest[signature] = shapes if largest is None else tuple(
            tuple(map(max, shape, top)) for shape, top in zip(shapes, largest))
