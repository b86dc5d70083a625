"""GPU-aligned compression of LLMs (GAC): a compressor proposes sizes, GAC re-selects aligned ones, save/load rebuilds."""

from .store import load, save

__all__ = ["load", "save"]
