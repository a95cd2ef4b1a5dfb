"""A weight push's calls and their outcome: the ``update_weights`` keywords, a push prepared
(``PreparedPush``), and the errors of one that failed, saying whether it went live all the same.

Both clients (``client.LogprobClient``, ``aio.AsyncLogprobClient``) make the calls; what is
decided about them is here.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TypedDict

import grpc
from logprob_proto import logprob_pb2 as pb
from logprob_proto.framing import Message

from .errors import DeadlineExceeded, LogprobError, PushOutcome, error_from_rpc

# A push's calls by default: 2 per weight receiver the server announces, at least DEFAULT_STREAMS
# (H100 hosts, 1.5B shape, 4 receivers and 4 push processes: 2.4 GB/s over 8 calls against 1.7-1.9
# over 4 on one host; on another, 2 receivers over 4 calls ran as fast as 4 over 8; RESULTS.md).
STREAMS_PER_RECEIVER = 2
# UpdateWeights, called with messages framed by ``weights`` (pieces framed around tensor bytes).
UPDATE_WEIGHTS = f"/{pb.DESCRIPTOR.services_by_name['LogprobService'].full_name}/UpdateWeights"
# A push that ends so may have gone live all the same (its commit reached the server first): the
# client asks ListModels before it raises (``PushOutcome``).
_INTERRUPTED = (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)
# What grpc.aio reports for a call whose request write failed because the call had ended
# (grpc/grpc#36066): the status is lost.
_STATUS_LOST = "Internal error from Core"


class UpdateKeywords(TypedDict, total=False):
    """The keywords of ``update_weights``: ``version`` (0: the live one + 1), ``partial`` (False: every
    weight must come; True: only those given are replaced), ``chunk_bytes`` (the size of the pieces
    tensors are streamed in), ``streams`` (how many UpdateWeights calls carry the push at once, each
    with its share of the tensors: 4, or 2 per weight receiver the server announces if that is more;
    1 with ``legacy_wire``), ``timeout`` (seconds), ``delta``
    (send only what changed since this client's last delta push of the model:
    ``weights.WeightDeltas``)."""

    version: int
    partial: bool
    chunk_bytes: int
    streams: int
    timeout: float | None
    delta: bool


@dataclass(frozen=True)
class PreparedPush:
    """A push, prepared: its calls' messages, where each call goes (None: the given channel), the
    calls' timeout, and the size of their pieces; its model and version, and the model's live
    version before it where the client knows it."""

    calls: list[Iterator[Message]]
    targets: list[str] | None
    timeout: float
    chunk_bytes: int
    model: str = ""
    version: int = 0
    live: int | None = None

    def interrupted(self, error: LogprobError, listed: Sequence[pb.ListModelsResponse]) -> LogprobError:
        """``error`` of a push cancelled or past its deadline, saying whether the push went live, from
        what ListModels answered after it (on several connections: the latest, the highest version)."""
        model = self.model or "default"
        version = self.version or (self.live + 1 if self.live is not None else None)
        infos = [m for answer in listed for m in answer.models if m.name == model]
        now = max(infos, key=lambda m: m.version, default=None)
        if now is None:
            outcome = PushOutcome(model, version, None, "", None)
        else:
            went_live = None if version is None or now.version > version else now.version == version
            outcome = PushOutcome(model, version, now.version, now.fingerprint, went_live)
        return _with_outcome(error, outcome)


def _with_outcome(error: LogprobError, outcome: PushOutcome) -> LogprobError:
    told = type(error)(f"{error.message}; {outcome}", error.code)
    told.push_outcome = outcome
    return told


def _status_lost(error: LogprobError) -> bool:
    return error.code == grpc.StatusCode.INTERNAL and error.message == _STATUS_LOST


def was_interrupted(error: LogprobError) -> bool:
    """Whether a push's call ended without the server's answer: cancelled, past its deadline, or
    its status lost."""
    return error.code in _INTERRUPTED or _status_lost(error)


def push_error(err: grpc.RpcError | LogprobError, deadline: float) -> LogprobError:
    """The typed error of a push's failed call. Past the push's deadline, a lost status (a write
    failed as the call had ended) or a call grpc cancelled itself is that deadline."""
    error = err if isinstance(err, LogprobError) else error_from_rpc(err)
    if (_status_lost(error) or error.code == grpc.StatusCode.CANCELLED) and time.monotonic() >= deadline:
        return DeadlineExceeded(
            f"the push's deadline passed while it was sending (gRPC reported {error}; grpc/grpc#36066)",
            grpc.StatusCode.DEADLINE_EXCEEDED,
        )
    return error


def unsent_error(error: LogprobError, model: str, version: int) -> LogprobError:
    """``error`` of the ListModels before a push: the push was never sent, which a cancelled or
    timed-out one's error says."""
    if not was_interrupted(error):
        return error
    return _with_outcome(error, PushOutcome(model or "default", version or None, None, "", went_live=False))


def ports_and_live(listed: pb.ListModelsResponse | None, model: str) -> tuple[Sequence[int], int | None]:
    """From ListModels before a push (None: not asked): the weight receivers' ports and the model's
    live version."""
    if listed is None:
        return (), None
    live = next((m.version for m in listed.models if m.name == (model or "default")), None)
    return listed.weight_receiver_ports, live
