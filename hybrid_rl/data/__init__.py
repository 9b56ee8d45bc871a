"""Data loading: prompt dataset, collation into a ``Batch`` and the epoch sampler."""

from .arithmetic import make_arithmetic_rows
from .dataset import RLDataset, collate_prompts, custom_rows, read_rows
from .sampler import EpochSampler

__all__ = ["EpochSampler", "RLDataset", "collate_prompts", "custom_rows", "make_arithmetic_rows", "read_rows"]
