"""ls_fairseq: fused-kernel Transformer training for fairseq, loaded with ``--user-dir``.

Importing the package registers, in fairseq's registries:

* model ``ls_transformer`` and the architectures ``ls_transformer``, ``ls_transformer_iwslt_de_en``,
  ``ls_transformer_wmt_en_de``, ``ls_transformer_vaswani_wmt_en_de_big``,
  ``ls_transformer_vaswani_wmt_en_fr_big``, ``ls_transformer_wmt_en_de_big``,
  ``ls_transformer_wmt_en_de_big_t2t``;
* criterion ``ls_label_smoothed_cross_entropy``;
* optimizer ``ls_adam``;

and installs the plugin's changes to fairseq's trainer classes (``fairseq_patches``).

Without torch or fairseq installed it does none of this (``REGISTERED`` is False), so that the
log-comparison tool ``ls-fairseq-compare`` works with either missing.
"""
import importlib.util
import os
import sys

__version__ = "0.6.0.dev0"  # CHANGELOG.md: Unreleased, after 0.5.0

#: the plugin's own command-line tools read their arguments before they need torch or fairseq
#: (``--help`` is instant); they call :func:`register` themselves when they do
_TOOLS = ("ls-fairseq-convert", "ls-fairseq-compare", "ls-fairseq-quickstart")


def register() -> None:
    """Register the ls_ components in fairseq's registries and install ``fairseq_patches``
    (idempotent: Python imports each module once, and the patches check themselves). On a
    fairseq the patches were not written for, importing them ends the process with one line."""
    from . import fairseq_patches  # first: its fairseq version check
    from . import criterions, models, optim  # noqa: F401  (registration side effects)

    fairseq_patches.install()


# The log tools (ls-fairseq-compare) need neither torch nor fairseq: without them, importing the
# package registers nothing instead of failing. With both installed, registration happens on
# import, as fairseq's --user-dir expects (any error in it is raised), except inside the
# plugin's own tools.
REGISTERED = (importlib.util.find_spec("torch") is not None
              and importlib.util.find_spec("fairseq") is not None
              and os.path.basename(sys.argv[0] if sys.argv else "") not in _TOOLS)

if REGISTERED:
    register()
