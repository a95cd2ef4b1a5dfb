"""A served model's weights as named tensors: fingerprints, what an update may replace, the swap.

A fingerprint is a blake2b digest over every weight's name, dtype, shape and the digest of its
bytes (``ops.digest``: computed on the GPU that holds them, the same on any device). Keeping the
per-weight digests lets an update digest only the tensors it brings (off the device thread), and
lets a LoRA model's fingerprint cover its base's weights and its adapter's without digesting the
base again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
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
    if not isinstance(tensor, DTensor):
        return tensor
    if tensor.dtype.itemsize == 1 and tensor.dtype.is_floating_point:
        # FP8 codes are gathered as their bytes: gloo has no 8-bit float type.
        raw = DTensor.from_local(
            tensor.to_local().view(torch.uint8),
            tensor.device_mesh,
            tensor.placements,
            shape=tensor.shape,
            stride=tensor.stride(),
        )
        return raw.full_tensor().view(tensor.dtype)
    return tensor.full_tensor()


def model_fingerprint(model: torch.nn.Module) -> str:
    return fingerprint(model_digests(model))


@dataclass(frozen=True)
class DenseConversion:
    """A weight served quantized that also takes its dense tensor, quantized on arrival with the
    checkpoint's own scheme (``models.quantized``) into the live tensors it writes."""

    shape: tuple[int, ...]  # the dense weight's
    writes: tuple[str, ...]  # the live tensors (state-dict names) it sets: the codes and their scales
    convert: Callable[[torch.Tensor], None]  # quantize a dense tensor into them (on the device thread)
    served_as: str  # the format, for messages


class UpdatableWeights:
    """The live tensors an update may replace, by name (each shares its parameter's storage).

    Names are the model's state-dict keys (for a LoRA model, PEFT's adapter state-dict keys).
    Tied weights (an lm_head that is the input embedding) answer to either name and count once
    towards a full update. A quantized weight (``conversions``, by its dense name: ``x.weight`` of
    an FP8 layer, an MXFP4 bank's ``gate_up_proj``) takes either its quantized tensors as they are
    served (FP8 codes and their scales, in the checkpoint's names) or its dense tensor, which is
    quantized on arrival; the scales it writes then count as sent.
    """

    def __init__(self, named: Mapping[str, torch.Tensor], conversions: Mapping[str, DenseConversion] = {}) -> None:
        self.live = dict(named)
        self.conversions = dict(conversions)
        self._storage = {name: (t.untyped_storage().data_ptr(), t.storage_offset()) for name, t in self.live.items()}
        first = {}
        for name, key in self._storage.items():
            first.setdefault(key, name)
        self._canonical = {name: first[key] for name, key in self._storage.items()}

    def canonical(self, name: str) -> str:
        """The name a weight is fingerprinted under: the first of the names sharing its storage (a
        quantized weight's dense name, which no live tensor has, stands for itself)."""
        return self._canonical.get(name, name)

    def check(self, name: str, dtype: str, shape: tuple[int, ...], *, sparse: bool = False) -> object:
        """The live tensor ``name`` stands for (a quantized weight's conversion, for its dense
        tensor); InvalidArgument naming the tensor when it does not fit."""
        live = self.live.get(name)
        conversion = self.conversions.get(name)
        if conversion is not None and (live is None or dtype != dtype_name(live.dtype)):
            if sparse:
                raise InvalidArgument(
                    f"tensor {name!r}: served {conversion.served_as}, so a sparse delta of its dense weight cannot "
                    "be applied; push it dense (quantized on arrival) or as its quantized tensors"
                )
            if tuple(shape) != conversion.shape:
                raise InvalidArgument(
                    f"tensor {name!r}: shape {list(shape)} does not match the model's {list(conversion.shape)}"
                )
            return conversion
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
        names = list(names)
        sent = [*names, *(w for n in names if (c := self.conversions.get(n)) for w in c.writes)]
        covered = {self.canonical(name) for name in sent}
        return [name for name in dict.fromkeys(self._canonical.values()) if name not in covered]

    def apply(self, staged: Mapping[str, torch.Tensor]) -> dict[str, TensorDigest]:
        """Copy every staged tensor into its live weight (a quantized weight's dense tensor:
        quantized into its live tensors); returns once the copies are done, with the digests of the
        live tensors quantized so (the served weights, which the fingerprint covers).

        Runs on the device thread between micro-batches: the copies are queued on the stream after
        the micro-batches already launched (which read the old weights) and before any later one.
        """
        quantized: list[str] = []
        with torch.no_grad():
            for name, tensor in staged.items():
                live = self.live.get(name)
                if live is not None and tensor.dtype == live.dtype:
                    live.copy_(tensor, non_blocking=True)
                else:
                    self.conversions[name].convert(tensor)
                    quantized += self.conversions[name].writes
        for device in {t.device for t in self.live.values() if t.device.type == "cuda"}:
            # The staged tensors are freed after this returns: they must not be read any more.
            torch.cuda.synchronize(device)
        return tensor_digests({name: self.live[name] for name in quantized})
