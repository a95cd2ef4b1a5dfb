"""A sparse tensor's pieces, checked as they come: indices ascend strictly across pieces and stay
within the tensor; the first bad one is named, by the piece's write (its ends are checked on the
event loop, the rest on a writer thread)."""

from __future__ import annotations

import concurrent.futures
import re

import numpy as np
import pytest
from logprob_service.domain import SparsePiece
from logprob_service.engine.weights.assembly import SparseAssembly
from logprob_service.errors import InvalidArgument

SHAPE = (10, 10)  # 100 elements


def piece(offset: int, indices: list[int], changed: int = 5) -> SparsePiece:
    return SparsePiece(
        "w",
        "float32",
        SHAPE,
        offset,
        changed,
        np.asarray(indices, "<u4").tobytes(),
        np.arange(len(indices), dtype="<f4").tobytes(),
    )


@pytest.fixture
def writers():
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        yield pool


def write(a: SparseAssembly, p: SparsePiece, writers: concurrent.futures.Executor) -> None:
    a.write(p, writers).result()


def test_pieces_that_ascend_across_their_edge_are_taken_whole(writers):
    a = SparseAssembly(piece(0, [3, 7]), live=None)
    write(a, piece(0, [3, 7]), writers)
    write(a, piece(2, [8, 50, 99]), writers)
    assert a.complete and a.indices.tolist() == [3, 7, 8, 50, 99]
    assert a.finish().indices is a.indices
    assert a.values.view("<f4").tolist() == [0, 1, 0, 1, 2]


@pytest.mark.parametrize(
    ("second", "bad"),
    [
        ([7, 50, 99], "changed element 2 has index 7"),  # equal to the last of the piece before
        ([5, 50, 99], "changed element 2 has index 5"),  # below it
        ([8, 50, 50], "changed element 4 has index 50"),  # not strictly ascending within the piece
        ([8, 60, 40], "changed element 4 has index 40"),
        ([8, 50, 100], "changed element 4 has index 100, out of [0, 100)"),  # past the tensor's end
    ],
)
def test_the_first_bad_index_is_named(second, bad, writers):
    a = SparseAssembly(piece(0, [3, 7]), live=None)
    write(a, piece(0, [3, 7]), writers)
    with pytest.raises(InvalidArgument, match=re.escape(f"tensor 'w': {bad}")):
        write(a, piece(2, second), writers)


def test_the_staging_of_a_tensor_whose_write_failed_raises_that_error(writers):
    a = SparseAssembly(piece(0, [3, 7]), live=None)
    write(a, piece(0, [3, 7]), writers)
    a.write(piece(2, [8, 60, 40]), writers)  # its ends are fine: the write finds the bad index
    assert a.complete
    with pytest.raises(InvalidArgument, match=re.escape("tensor 'w': changed element 4 has index 40")):
        a.finish()
