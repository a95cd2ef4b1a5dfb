"""The float64 full-softmax top-k of a model's own logits, and checking a served top-k against it."""

from __future__ import annotations

import numpy as np
import torch
from logprob_service.domain import TokenSequence

from tests.helpers.models import stock_copy


def full_logp(model: torch.nn.Module, seq: TokenSequence, temperature: float = 1.0) -> np.ndarray:
    """[C, V] float64 log-probs of every vocabulary id at each completion position."""
    ids = torch.from_numpy(np.concatenate([seq.prompt_ids, seq.completion_ids]))[None]
    with torch.no_grad():
        logits = stock_copy(model, torch.float64)(input_ids=ids).logits[0] / temperature
    p = len(seq.prompt_ids)
    return logits[p - 1 : -1].log_softmax(-1).numpy()


def assert_top_k(top_ids: np.ndarray, top_lps: np.ndarray, logp: np.ndarray, k: int, atol: float) -> None:
    """``top_ids`` [C, k] int32 and ``top_lps`` [C, k] float32 are the top-k of ``logp`` [C, V]: the
    values within ``atol`` of the reference's k largest, each the reference's value at its id, and
    the ids the reference's (ties by the smaller id) wherever its neighbouring values are further
    apart than 2 ``atol`` (closer ones may swap in float32)."""
    assert top_ids.dtype == np.int32 and top_lps.dtype == np.float32 and top_ids.shape == (len(logp), k)
    order = np.argsort(-logp, axis=-1, kind="stable")
    want = np.take_along_axis(logp, order, -1)
    np.testing.assert_allclose(top_lps, want[:, :k], atol=atol, rtol=0)
    np.testing.assert_allclose(top_lps, np.take_along_axis(logp, top_ids.astype(np.int64), -1), atol=atol, rtol=0)
    gaps = np.pad(want[:, :-1] - want[:, 1:], ((0, 0), (0, 1)), constant_values=np.inf)
    clear = gaps[:, :k] > 2 * atol
    clear[:, 1:] &= gaps[:, : k - 1] > 2 * atol
    assert (top_ids == order[:, :k])[clear].all()
