"""Several GPUs: the gradient all-reduce and what builds on it, for the training-step engine
(``ls_fairseq.graphs``) and ls_adam (``ls_fairseq.optim``). Who calls whom in one update, on one
GPU and on several: docs/DESIGN.md.

Map:

* ``reducer``: ``GradientReducer``, the engine's all-reduce: bucket plan, NCCL or copy engines,
  issued at the end of the backward; it records what it did;
* ``exchange``: ``GradientExchange``, that record handed to the optimizer once per update
  (``exchange_of(model)``; ``register`` is called by the engine);
* ``grad_buckets`` / ``flat_all_reduce``: the all-reduce during the backward / after it (the
  latter is ls_adam's ``all_reduce_grads``);
* ``peer_all_reduce``: a bucket's all-reduce by copy engines (GPUs of one host), instead of NCCL;
* ``shard_plan``: where every shard of every bucket lives (``ShardPlan``), the flat layout's
  ``ALIGN``;
* ``sharded_step``: the optimizer step on the shards a rank sums (ls_adam drives it);
* ``collective_setup``: the set-up steps every rank decides alike (a local failure becomes a
  reason every rank sees), shared by ``peer_all_reduce.create`` and ``sharded_step.create``;
* ``async_stats``: fairseq's per-update exchanges between workers (logging outputs, grad-norm
  agreement) without waiting for the GPU (``--ls-async-stats``; installed by
  ``fairseq_patches``).

Imports: this package uses ``ls_fairseq.switches``, ``training_config``, ``wrappers``,
``host_copy`` and ``ops`` (peer memory, the shard sum, the flag barrier), never ``graphs``,
``criterions``, ``optim``, ``models``, ``modules``, ``generation``, ``data`` or
``fairseq_patches`` (``graphs`` and ``optim`` import it:
tests/test_import_graph.py). Its one piece of process-wide state is the weak registry of
``exchange`` (why: see there).
"""
from .exchange import NOTHING, REDUCED, SCATTERED, GradientExchange, exchange_of, reducer_of
from .flat_all_reduce import all_reduce_flat
from .reducer import GradientReducer

__all__ = ["NOTHING", "REDUCED", "SCATTERED", "GradientExchange", "GradientReducer",
           "all_reduce_flat", "exchange_of", "reducer_of"]
