"""A served model's weights as named tensors: fingerprints, what an update may replace, the swap.

A fingerprint is a blake2b digest over every weight's name, dtype, shape and the digest of its
bytes (``ops.digest``: computed on the GPU that holds them, the same on any device). Keeping the
per-weight digests lets an update digest only the tensors it brings (off the device thread), and
lets a LoRA model's fingerprint cover its base's weights and its adapter's without digesting the
base again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from logprob_service.errors import InvalidArgument
from logprob_service.ops.digest import digest_lanes, lanes_hex


@dataclass(frozen=True)
class TensorDigest:
    dtype: str  # "bfloat16"
    shape: tuple[int, ...]
    digest: str  # ops.digest.lanes_hex of the raw bytes' lanes, 32 hex digits


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class PendingDigest:
    """A tensor's digest whose lanes are computed (or queued, on a GPU) but not yet read back."""

    dtype: str
    shape: tuple[int, ...]
    lanes: torch.Tensor  # ops.digest.digest_lanes


def pending_digest(tensor: torch.Tensor, device: torch.device | None = None) -> PendingDigest:
    """The digest of one tensor's raw bytes, queued (``ops.digest.digest_lanes``: on ``device`` when
    it is a GPU, else where the tensor is); ``settle`` reads it."""
    return PendingDigest(dtype_name(tensor.dtype), tuple(tensor.shape), digest_lanes(tensor, device))


def settle(pending: Sequence[PendingDigest]) -> list[TensorDigest]:
    """The digests of ``pending``, read back at once (one wait and one copy per device)."""
    hexes = lanes_hex([p.lanes for p in pending])
    return [TensorDigest(p.dtype, p.shape, h) for p, h in zip(pending, hexes, strict=True)]


def tensor_digests(named: Mapping[str, torch.Tensor]) -> dict[str, TensorDigest]:
    """The digest of every tensor's bytes, each computed where it lives, read back at once."""
    return dict(zip(named, settle([pending_digest(t) for t in named.values()]), strict=True))


def fingerprint(digests: Mapping[str, TensorDigest]) -> str:
    """One hex digest for a set of weights: equal fingerprints, equal names, dtypes, shapes, bytes."""
    combined = hashlib.blake2b(digest_size=16)
    for name in sorted(digests):
        d = digests[name]
        combined.update(f"{name}|{d.dtype}|{d.shape}|{d.digest}\n".encode())
    return combined.hexdigest()


def unique_weights(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Named tensors with each storage once (tied embeddings appear under one name): the first name wins."""
    seen: set[tuple[int, int]] = set()
    unique: dict[str, torch.Tensor] = {}
    for name, tensor in named:
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key not in seen:
            seen.add(key)
            unique[name] = tensor
    return unique


def model_digests(model: torch.nn.Module) -> dict[str, TensorDigest]:
    """Digests of a model's state dict, each storage once (see ``unique_weights``). A weight sharded
    over a tensor-parallel group (a DTensor) is digested whole, as one GPU holding the same weights
    digests it: it is gathered, one at a time, which is a collective (every rank of the group calls
    this, in the same order)."""
    state = model.state_dict()
    unique = unique_weights((name, _local(tensor)) for name, tensor in state.items())
    return dict(zip(unique, settle([pending_digest(_whole(state[name])) for name in unique]), strict=True))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def model_fingerprint(model: torch.nn.Module) -> str:
    return fingerprint(model_digests(model))


class UpdatableWeights:
    """The live tensors an update may replace, by name (each shares its parameter's storage).

    Names are the model's state-dict keys (for a LoRA model, PEFT's adapter state-dict keys).
    Tied weights (an lm_head that is the input embedding) answer to either name and count once
    towards a full update.
    """

    def __init__(self, named: Mapping[str, torch.Tensor]) -> None:
        self.live = dict(named)
        self._storage = {name: (t.untyped_storage().data_ptr(), t.storage_offset()) for name, t in self.live.items()}
        first = {}
        for name, key in self._storage.items():
            first.setdefault(key, name)
        self._canonical = {name: first[key] for name, key in self._storage.items()}

    def canonical(self, name: str) -> str:
        """The name a weight is fingerprinted under: the first of the names sharing its storage."""
        return self._canonical[name]

    def check(self, name: str, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The live tensor ``name`` stands for; InvalidArgument naming the tensor when it does not fit."""
        live = self.live.get(name)
        if live is None:
            raise InvalidArgument(
                f"tensor {name!r}: no such weight in the model ({len(self.live)} weights; "
                f"e.g. {', '.join(sorted(self.live)[:3])})"
            )
        if dtype != dtype_name(live.dtype):
            raise InvalidArgument(f"tensor {name!r}: dtype {dtype} does not match the model's {dtype_name(live.dtype)}")
        if tuple(shape) != tuple(live.shape):
            raise InvalidArgument(f"tensor {name!r}: shape {list(shape)} does not match the model's {list(live.shape)}")
        return live

    def missing(self, names: Iterable[str]) -> list[str]:
        """The weights (one name per storage) that ``names`` leaves out."""
        covered = {self.canonical(name) for name in names}
        return [name for name in dict.fromkeys(self._canonical.values()) if name not in covered]

    def apply(self, staged: Mapping[str, torch.Tensor]) -> None:
        """Copy every staged tensor into its live weight; returns once the copies are done.

        Runs on the device thread between micro-batches: the copies are queued on the stream after
        the micro-batches already launched (which read the old weights) and before any later one.
        """
        with torch.no_grad():
            for name, tensor in staged.items():
                self.live[name].copy_(tensor, non_blocking=True)
        for device in {t.device for t in self.live.values() if t.device.type == "cuda"}:
            # The staged tensors are freed after this returns: they must not be read any more.
            torch.cuda.synchronize(device)
