"""The hand-off from the training-step engine to the optimizer: one ``GradientExchange`` per
update, saying what happened to the gradients before the optimizer step.

fairseq's trainer calls ``optimizer.all_reduce_grads(model)`` after the backward, with the model
and nothing of the criterion whose engine (``graphs.CudaGraphedLoss``) keeps the gradients. So the
engine registers its ``reducer.GradientReducer`` for the model (``register``) and the optimizer
takes the update's exchange from there in one call, ``exchange_of(module)``: the one place where
the optimizer side learns what the engine did. Taking it resets the reducer's record (the reducer's
own state, reset by the reducer), so each exchange is handed over once.

Why a registry: ``_REGISTRY`` is a ``weakref.WeakKeyDictionary`` keyed by the innermost model
(the one inside the trainer's wrappers: ModuleProxyWrapper, legacy DDP, torch DDP): an entry lives
exactly as long as its model. It is the package's only process-wide state.
"""
import weakref

from ..wrappers import innermost

#: the kinds of exchange: nothing was reduced during the backward (the optimizer side reduces,
#: or no reduction is due); every flat buffer was all-reduced; each rank holds only the summed
#: shards it owns (the copy-engine all-reduce without its last phase: the sharded step follows)
NOTHING, REDUCED, SCATTERED = "nothing", "reduced", "scattered"

_REGISTRY = weakref.WeakKeyDictionary()  # innermost model -> its GradientReducer


class GradientExchange:
    """What the engine did to one update's gradients (read-only).

    * ``grads``: the model's ``FlatGradients`` (``graphs.flat_gradients``);
    * ``kind``: ``NOTHING``, ``REDUCED`` or ``SCATTERED``; ``reduced``: not ``NOTHING`` (the
      all-reduce of every flat buffer was issued during the backward, in full or scattered);
      ``scattered``: ``kind == SCATTERED``;
    * ``peer``: the copy-engine all-reduce (``peer_all_reduce.PeerAllReduce``) the engine chose
      for this run, else None (NCCL's, or not decided yet): its shard plan and barrier are what
      the sharded optimizer step (``sharded_step.create``) builds on.
    """

    __slots__ = ("_grads", "_kind", "_peer")

    def __init__(self, grads, kind=NOTHING, peer=None):
        if kind not in (NOTHING, REDUCED, SCATTERED):
            raise ValueError(f"GradientExchange: unknown kind {kind!r}")
        self._grads, self._kind, self._peer = grads, kind, peer

    grads = property(lambda self: self._grads)
    kind = property(lambda self: self._kind)
    peer = property(lambda self: self._peer)
    reduced = property(lambda self: self._kind != NOTHING)
    scattered = property(lambda self: self._kind == SCATTERED)

    def __repr__(self):
        return f"GradientExchange({self._kind}, peer={'yes' if self._peer else 'no'})"


def register(model, reducer):
    """``reducer`` (a ``GradientReducer``) keeps the gradients of ``model`` (or of the model
    inside its wrappers)."""
    _REGISTRY[innermost(model)] = reducer


def reducer_of(module):
    """The ``GradientReducer`` registered for ``module`` (or for the model inside its wrappers),
    or None: no engine keeps this model's gradients."""
    return _REGISTRY.get(innermost(module))


def exchange_of(module):
    """This update's ``GradientExchange`` for ``module``'s gradients, taken from the engine's
    reducer (a second call in the same update says ``NOTHING``); None where no engine keeps
    them. Called by ls_adam's ``all_reduce_grads`` (fairseq passes it only the model)."""
    reducer = reducer_of(module)
    return None if reducer is None else reducer.take_exchange()
