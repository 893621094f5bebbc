"""Decoding: fairseq's beam search with fixed shapes, replayed as CUDA graphs (``generator``)
over a search state kept on the device (``beam_search``)."""
from .beam_search import BeamState
from .generator import LSSequenceGenerator

__all__ = ["BeamState", "LSSequenceGenerator"]
