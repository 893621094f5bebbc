"""The tests' name for ls_fairseq/testing/fairseq_helpers.py (bench/ imports it from there)."""
from ls_fairseq.testing.fairseq_helpers import *  # noqa: F401,F403
