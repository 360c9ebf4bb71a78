"""Model loading and per-architecture knowledge."""

from .arch import ARCHITECTURES, ArchSpec, arch_for
from .load import ALIASES, LoadedModel, load_model

__all__ = ["ARCHITECTURES", "ALIASES", "ArchSpec", "LoadedModel", "arch_for", "load_model"]
