"""Data loading: prompt dataset, collation into a ``Batch`` and the epoch sampler (or a sampler of the user's)."""

from .arithmetic import make_arithmetic_rows
from .dataset import RLDataset, collate_prompts, custom_rows, read_rows
from .sampler import CustomSampler, EpochSampler, load_custom_sampler

__all__ = ["CustomSampler", "EpochSampler", "RLDataset", "collate_prompts", "custom_rows", "load_custom_sampler",
           "make_arithmetic_rows", "read_rows"]
