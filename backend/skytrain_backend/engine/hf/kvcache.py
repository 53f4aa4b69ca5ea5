"""Batch surgery on transformers' ``DynamicCache``: how sequences join and leave a running batch.

Every sequence in the batch is left-padded to a common length, so a cache is a stack of
``(B, heads, L, head_dim)`` key and value tensors per layer plus a ``(B, L)`` attention mask.
A new group joins by padding the shorter of the two on the left and concatenating along the
batch; finished sequences leave by selecting rows, and columns that became padding for every
remaining row are dropped. Sliding-window layers keep only a window and cannot be re-aligned
this way, so a model that has them decodes one group at a time (``is_mergeable``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def is_mergeable(cache: DynamicCache) -> bool:
    return all(type(layer) is DynamicLayer for layer in cache.layers)


def _layers(cache: DynamicCache) -> list[Any]:
    """The cache's layers, which ``is_mergeable`` checked are plain ``DynamicLayer``s."""
    return list(cache.layers)


def left_pad(cache: DynamicCache, mask_BL: torch.Tensor, columns: int) -> torch.Tensor:
    """Prepend ``columns`` padding positions to every row; returns the widened mask."""
    if columns == 0:
        return mask_BL
    for layer in _layers(cache):
        layer.keys = F.pad(layer.keys, (0, 0, columns, 0))
        layer.values = F.pad(layer.values, (0, 0, columns, 0))
    return F.pad(mask_BL, (columns, 0))


def concatenate(into: DynamicCache, other: DynamicCache) -> None:
    """Append ``other``'s rows to ``into`` (both already padded to the same length)."""
    for layer, extra in zip(_layers(into), _layers(other), strict=True):
        layer.keys = torch.cat([layer.keys, extra.keys])
        layer.values = torch.cat([layer.values, extra.values])


def keep_rows(cache: DynamicCache, mask_BL: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Keep only ``rows`` and drop leading columns that are padding in all of them."""
    mask_BL = mask_BL[rows]
    for layer in _layers(cache):
        layer.batch_select_indices(rows)
    first_used = int(mask_BL.any(dim=0).nonzero()[0])
    if first_used:
        for layer in _layers(cache):
            layer.keys = layer.keys[:, :, first_used:]
            layer.values = layer.values[:, :, first_used:]
        mask_BL = mask_BL[:, first_used:]
    return mask_BL
