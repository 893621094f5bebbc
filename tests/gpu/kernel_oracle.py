"""The GPU tests' name for ls_fairseq/testing/kernel_oracle.py (scripts/ import it from there)."""
from ls_fairseq.testing.kernel_oracle import *  # noqa: F401,F403
