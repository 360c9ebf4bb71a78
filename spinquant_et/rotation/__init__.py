"""Function-preserving rotations: norm fusion, offline R1/R2, online R3/R4."""

from .apply import random_rotations, rotate_model
from .fuse import fuse_norms

__all__ = ["fuse_norms", "random_rotations", "rotate_model"]
