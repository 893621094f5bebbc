"""``ls_fairseq.cuda_capture.collector_paused``: Python's cyclic collector is off inside (no
automatic collection frees a cycle there) and back as it was after, also after an error. The
capture sites use it (read from their source); the abort it prevents is reproduced on a GPU in
``tests/gpu/test_capture_gc_cuda.py``."""
import gc
import inspect
import weakref

import pytest

from ls_fairseq.cuda_capture import collector_paused
from ls_fairseq.generation import generator
from ls_fairseq.graphs import replay


class _Node:
    pass


def _cycle():
    """A reference cycle only the cyclic collector frees, and a weak reference to it."""
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


@pytest.fixture
def low_threshold():
    """The collector runs after every few allocations (as if a long capture allocated a lot)."""
    old = gc.get_threshold()
    was = gc.isenabled()
    gc.enable()
    gc.set_threshold(1, 1, 1)
    yield
    gc.set_threshold(*old)
    (gc.enable if was else gc.disable)()


def test_no_cycle_is_collected_inside(low_threshold):
    with collector_paused():
        assert not gc.isenabled()
        ref = _cycle()
        kept = [_Node() for _ in range(10_000)]  # would trigger collections at threshold 1
        assert ref() is not None
    assert gc.isenabled()
    # the control: the same allocations with the collector on free the cycle
    ref = _cycle()
    kept += [_Node() for _ in range(10_000)]
    assert ref() is None


def test_restored_after_an_error(low_threshold):
    with pytest.raises(ValueError):
        with collector_paused():
            raise ValueError("capture failed")
    assert gc.isenabled()


def test_a_disabled_collector_stays_disabled():
    was = gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()


@pytest.mark.parametrize("site", [replay.CudaGraphedLoss._captured, generator._capture])
def test_every_capture_site_pauses_the_collector(site):
    """capture_begin is called only inside ``with collector_paused():``."""
    source = inspect.getsource(site)
    call = "graph.capture_begin("
    assert source.count(call) == 1
    before, _, inside = source.partition("with collector_paused():")
    assert call in inside and call not in before
