"""What the attention backends share: the dtypes flash kernels run, flash attention's window
convention, and the merge of two key sets' attention by log-sum-exp.

Merging by log-sum-exp: for two disjoint key sets A and B of the same query rows,
``o = (exp(lse_A) o_A + exp(lse_B) o_B) / (exp(lse_A) + exp(lse_B))`` and
``lse = logaddexp(lse_A, lse_B)`` are exactly attention over A u B: ``merge_attention`` does it.
(``sdpa_cudnn`` splits a chunk's keys in two this way.)

Attention sinks from the log-sum-exp: a sink logit s joins each row's softmax without a value, so
``p_j = exp(x_j) / (exp(lse) + exp(s)) = softmax_j * sigmoid(lse - s)``: a fast kernel's output
times ``sigmoid(lse - s)`` is exactly attention with the sink (``apply_sinks``).
"""

from __future__ import annotations

import torch

FLASH_DTYPES = (torch.float16, torch.bfloat16)
"""The dtypes the flash kernels (cuDNN's and FlashAttention-2) run."""


def varlen_window_size(sliding_window: int | None) -> tuple[int, int]:
    """transformers' causal window of ``w`` positions (self included) as flash attention's
    inclusive (left, right) window: (w - 1, 0); plain causal is (-1, 0)."""
    if sliding_window is None:
        return (-1, 0)
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
    return (int(sliding_window) - 1, 0)


def merge_attention(
    out1: torch.Tensor, lse1: torch.Tensor, out2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two disjoint key sets, from each set's (out, lse).

    out1, out2: [T, H, D]; lse1, lse2: [T, H] float32, natural log (``cudnn_varlen_attention``'s
    convention, and that of torch's cuDNN op in ``sdpa_cudnn``). With lse = logaddexp(lse1, lse2),
    the softmax weights of set A are exp(x_j - lse) = exp(x_j - lse1) * exp(lse1 - lse), so
    o = exp(lse1 - lse) o1 + exp(lse2 - lse) o2, computed in float32 and returned in out1's dtype
    with lse [T, H] float32. A part whose lse is -inf (no allowed key) contributes nothing, whatever
    its out holds.
    """
    lse = torch.logaddexp(lse1, lse2)  # [T, H]
    finite = torch.where(torch.isneginf(lse), 0.0, lse)  # rows with no key anywhere: weights exp(-inf) = 0

    def part(out: torch.Tensor, part_lse: torch.Tensor) -> torch.Tensor:  # [T, H, D] float32
        weight = torch.exp(part_lse - finite).unsqueeze(-1)
        return torch.where(weight > 0, weight * out.float(), 0.0)

    return (part(out1, lse1) + part(out2, lse2)).to(out1.dtype), lse


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention with sinks from attention without them: out [T, H, D], lse [T, H] (natural log over
    the allowed keys), sinks [H] -> [T, H, D] in out's dtype, scaled in float32 (see the module
    docstring). A row with no allowed key (lse -inf) gives all its probability to the sink: 0."""
    share = torch.sigmoid(lse.float() - sinks.float()[None, :]).unsqueeze(-1)  # [T, H, 1]
    return (out.float() * share).to(out.dtype)
