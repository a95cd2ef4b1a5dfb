"""Whether staged weights hold a NaN or an infinity, found where they lie, with the digest's wait.

A weight update's tensors are checked before they go live (``worker.staging``, the
``check_finite_weights`` setting): one NaN in a weight turns every score of the model into NaN.
The check is queued beside each tensor's digest, on the same stream, and read back with the
digests, so it adds no wait: per tensor one reduction over its elements (``probe``), where the
tensor lies, and for a sparse update's tensors one pass over their changed values alone
(``segment_probes``). ``nonfinite`` reads every probe back with one copy per device.

A probe is a small tensor whose values are all finite exactly when the tensor's are: its
smallest and largest element, in its own dtype (``torch.aminmax`` propagates NaN; an infinity is
one of the two; for float8_e4m3fn, which torch cannot reduce, NaN or 0), or for changed values
0 or NaN per tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def probe(tensor: torch.Tensor) -> torch.Tensor | None:
    """[2] of ``tensor``'s dtype on its device, both finite iff all of ``tensor`` is, queued on
    the current stream; None where no element can be non-finite (integer or bool dtypes, no
    elements)."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return None
    flat = tensor.detach().reshape(-1)
    if tensor.dtype == torch.float8_e4m3fn:
        # No reductions in this dtype, and no infinity in it: NaN is every exponent and mantissa bit set.
        nan = ((flat.view(torch.uint8) & 0x7F) == 0x7F).any()
        return torch.where(nan, torch.nan, 0.0).float().reshape(1).expand(2)
    return torch.stack(torch.aminmax(flat))


def segment_probes(values: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """One probe per segment of ``values`` (flat, one float dtype), the segments of ``counts``
    (int64, on ``values``' device) elements back to back: [len(counts), 1] float64, NaN where the
    segment holds a non-finite value, else 0."""
    bad = torch.zeros(counts.numel(), dtype=torch.float64, device=values.device)
    if values.numel():
        segment = torch.repeat_interleave(
            torch.arange(counts.numel(), device=values.device), counts, output_size=values.numel()
        )
        bad.index_add_(0, segment, (~torch.isfinite(values)).to(torch.float64))
    return torch.where(bad > 0, torch.nan, 0.0).unsqueeze(1)


def nonfinite(probes: Sequence[torch.Tensor | None]) -> list[int]:
    """The indices of ``probes`` that hold a non-finite value, read back with one copy per device
    and dtype (which waits for the current stream there)."""
    groups: dict[tuple[torch.device, torch.dtype, int], list[tuple[int, torch.Tensor]]] = {}
    for i, one in enumerate(probes):
        if one is not None:
            groups.setdefault((one.device, one.dtype, one.numel()), []).append((i, one))
    bad: list[int] = []
    for group in groups.values():
        finite = torch.isfinite(torch.stack([one for _, one in group])).all(dim=1).tolist()
        bad += [i for (i, _), ok in zip(group, finite, strict=True) if not ok]
    return sorted(bad)
