"""Keys: a logit and its token id packed in one int64 whose signed order is "larger logit first,
then smaller id first", so the K largest keys of a row are its top-k with ties broken by id,
whatever order they were found in.

The high word is the float32 bits of z made monotonic as a signed int (``ordered_bits``), the low
word 2^31 - 1 - id (``keys_of``); ``logprobs.topk_keys`` builds the same keys in torch for the eager
path. The encoding and its edge cases (-0.0, NaN, -inf): docs/how-it-works.md, "Keys".
"""

from __future__ import annotations

import triton
import triton.language as tl

# A key below every logit's (the smallest int64): empty slots, and "no threshold".
MIN_KEY = -(2**63)
# Below every ``ordered_bits`` of a float but -NaN's: an element already taken (``compact_survivors``).
# (Kernels read only constexpr globals: the interpreter reads any, so only a compiled kernel tells.)
TAKEN = tl.constexpr(-(2**31))
# ``ordered_bits`` of -FLT_MAX: one above -inf's.
ABOVE_NEG_INF = -2139095040
KEY_MIN = tl.constexpr(MIN_KEY)
KEY_MAX = tl.constexpr(2**63 - 1)


@triton.jit
def ordered_bits(z):
    """The high word of a key: float32 ``z``'s bits as an int32 of the same order."""
    b = z.to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)  # b ^ 0x7FFFFFFF where b < 0: a shift and one logic op


@triton.jit
def keys_of(ordered, ids):
    """int64 keys from ``ordered_bits`` and int ``ids`` (broadcastable)."""
    return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - ids.to(tl.int64))
