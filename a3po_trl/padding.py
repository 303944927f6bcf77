"""Rows of different lengths made into padded tensors: token ids with their attention mask, or per-token values."""

from __future__ import annotations

import torch
from trl.trainer.utils import pad


def pad_rows(rows: list[list[int]], pad_value: int, side: str, pad_to_multiple_of: int | None = None):
    """Token id rows padded into ``(ids, mask)`` tensors on the given side."""
    tensors = [torch.tensor(row, dtype=torch.long) for row in rows]
    ids = pad(tensors, padding_value=pad_value, padding_side=side, pad_to_multiple_of=pad_to_multiple_of)
    mask = pad(
        [torch.ones_like(t) for t in tensors],
        padding_value=0,
        padding_side=side,
        pad_to_multiple_of=pad_to_multiple_of,
    )
    return ids, mask


def pad_values(rows, value, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Per-token rows (lists or 1-D tensors) right-padded with ``value`` to ``width`` columns (the width of the
    padded completion ids they belong to)."""
    tensors = [torch.as_tensor(row, dtype=dtype) for row in rows]
    padded = pad(tensors, padding_value=value, padding_side="right")
    return torch.nn.functional.pad(padded, (0, width - padded.size(1)), value=value)
