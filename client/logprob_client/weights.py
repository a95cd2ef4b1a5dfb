"""The client's weight API, its public face: ``from logprob_client.weights import WeightDeltas``.

The names users import live here; the work is done in rooms of one job each:

- ``logprob_proto.framing``: how an UpdateWeights call's messages are laid out (pieces, packing,
  sparse indices), the one framing the client writes and the server reads;
- ``streams``: a push split into calls, each a stream of messages read a tensor at a time
  (``update_streams``, ``update_requests``, ``split``, ``UpdateResult``);
- ``deltas`` (``WeightDeltas``) and ``compare``: delta pushes, sending only what changed.
"""

from logprob_proto.framing import (
    MAX_SPARSE_ELEMENTS,
    Message,
    dense_parts,
    dense_piece,
    join,
    packed,
    sparse_parts,
    sparse_piece,
)

from .compare import PART_ELEMENTS, changes, set_elements
from .deltas import WeightDeltas
from .streams import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_STREAMS,
    LOOKAHEAD,
    UpdateResult,
    named_tensors,
    raw_bytes,
    split,
    update_requests,
    update_streams,
)

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_STREAMS",
    "LOOKAHEAD",
    "MAX_SPARSE_ELEMENTS",
    "PART_ELEMENTS",
    "Message",
    "UpdateResult",
    "WeightDeltas",
    "changes",
    "dense_parts",
    "dense_piece",
    "join",
    "named_tensors",
    "packed",
    "raw_bytes",
    "set_elements",
    "sparse_parts",
    "sparse_piece",
    "split",
    "update_requests",
    "update_streams",
]
