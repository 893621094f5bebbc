"""ls_fairseq: fused-kernel Transformer training for fairseq, loaded with ``--user-dir``.

Importing the package registers, in fairseq's registries:

* model ``ls_transformer`` and the architectures ``ls_transformer``, ``ls_transformer_iwslt_de_en``,
  ``ls_transformer_wmt_en_de``, ``ls_transformer_vaswani_wmt_en_de_big``,
  ``ls_transformer_vaswani_wmt_en_fr_big``, ``ls_transformer_wmt_en_de_big``,
  ``ls_transformer_wmt_en_de_big_t2t``;
* criterion ``ls_label_smoothed_cross_entropy``;
* optimizer ``ls_adam``.
"""
from . import checkpoint_compat

checkpoint_compat.allow_fairseq_checkpoints()

from . import criterions, models, optim  # noqa: E402,F401  (registration side effects)

__version__ = "0.1.0"
