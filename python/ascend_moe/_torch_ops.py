"""torch custom ops (`torch.ops.ascend_moe.*`) for the local ops, with fake
implementations that call the library's shape functions. Imported only when
torch is importable; CPU tensors only (NPU tensors need the NPU backend)."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from . import ops, shapes


def _np(t: Optional[torch.Tensor]):
    if t is None:
        return None
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _torch(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def register() -> bool:
    """Registers the ops once; False when this torch lacks `torch.library.custom_op`."""
    if not hasattr(torch, "library") or not hasattr(torch.library, "custom_op"):
        return False

    @torch.library.custom_op("ascend_moe::moe_finalize_routing", mutates_args=())
    def moe_finalize_routing(
        expanded_x: torch.Tensor,
        expanded_row_idx: torch.Tensor,
        x1: Optional[torch.Tensor] = None,
        x2: Optional[torch.Tensor] = None,
        bias: Optional[torch.Tensor] = None,
        scales: Optional[torch.Tensor] = None,
        expert_idx: Optional[torch.Tensor] = None,
        drop_pad_mode: int = 0,
    ) -> torch.Tensor:
        y = ops.moe_finalize_routing(*[_np(t) for t in (expanded_x, expanded_row_idx, x1, x2, bias, scales, expert_idx)], drop_pad_mode)
        return _torch(y, expanded_x.dtype)

    @moe_finalize_routing.register_fake
    def _(expanded_x, expanded_row_idx, x1=None, x2=None, bias=None, scales=None, expert_idx=None, drop_pad_mode=0):
        shape = shapes.moe_finalize_routing(expanded_x, expanded_row_idx, x1, x2, bias, scales, expert_idx, drop_pad_mode)
        return expanded_x.new_empty(shape)

    @torch.library.custom_op("ascend_moe::moe_token_unpermute", mutates_args=())
    def moe_token_unpermute(
        permuted: torch.Tensor, sorted_indices: torch.Tensor, probs: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        y = ops.moe_token_unpermute(_np(permuted), _np(sorted_indices), _np(probs))
        return _torch(y, permuted.dtype)

    @moe_token_unpermute.register_fake
    def _(permuted, sorted_indices, probs=None):
        return permuted.new_empty(shapes.moe_token_unpermute(permuted, sorted_indices, probs))

    return True
