"""The files LoadWeights reads: a path's .safetensors files, each checked after its symlinks are
followed to be a regular file where LoadWeights may read."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Sequence
from pathlib import Path

from logprob_service.errors import InvalidArgument

# Where LoadWeights never reads, wherever a path's symlinks lead: kernel interfaces and devices,
# whose files block in open (a FIFO), never end (/dev/urandom), or are the server's own memory and
# environment (/proc/self/mem, /proc/self/environ).
FORBIDDEN_ROOTS = (Path("/proc"), Path("/sys"), Path("/dev"))
# A path longer than this is cut in the middle where a message shows it (a caller may send 5,000
# characters; the log line and the status need not repeat them).
SHOWN_PATH_CHARS = 200


def _shown_path(path: str | Path) -> str:
    """``path`` quoted for a message, its middle cut when it is long."""
    text = str(path)
    if len(text) > SHOWN_PATH_CHARS:
        text = f"{text[:120]}...({len(text)} characters)...{text[-60:]}"
    return repr(text)


def _file_kind(mode: int) -> str:
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    )
    return next((kind for test, kind in kinds if test(mode)), "not a regular file")


def _outside(where: str, roots: Sequence[Path]) -> InvalidArgument:
    return InvalidArgument(
        f"path: {where} is outside the directories LoadWeights may read, or does not exist "
        f"(load_weights_roots and the served checkpoints: {', '.join(map(str, roots))})"
    )


def _resolve(name: Path, where: str, roots: Sequence[Path]) -> tuple[Path, os.stat_result]:
    """``name`` with its symlinks followed, and its stat, once checked to lie outside
    ``FORBIDDEN_ROOTS`` and, when any are given, under one of ``roots``. ``where``: how messages
    name it.

    With ``roots``, a path outside them gets one answer whether it exists or not, and never says
    where its symlinks lead: its place is checked first, its symlinks followed as far as they
    exist, and only a path inside may be told apart as missing or unreadable."""
    if roots:
        try:
            loose = name.expanduser().resolve(strict=False)
        except (OSError, RuntimeError, ValueError):  # a symlink loop, no such user (~x), a NUL
            raise _outside(where, roots) from None
        if not any(loose.is_relative_to(root) for root in roots):
            raise _outside(where, roots)
    try:
        resolved = name.expanduser().resolve(strict=True)
        info = resolved.stat()
    except FileNotFoundError:
        raise InvalidArgument(f"path: {where} does not exist on the server") from None
    except (OSError, RuntimeError, ValueError) as err:  # too long, a symlink loop, no such user (~x), a NUL
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise InvalidArgument(f"path: {where} cannot be resolved on the server ({reason})") from None
    where += _leads_to(name, resolved)
    if any(resolved.is_relative_to(forbidden) for forbidden in FORBIDDEN_ROOTS):
        raise InvalidArgument(f"path: {where} is under /proc, /sys or /dev, which LoadWeights never reads")
    if roots and not any(resolved.is_relative_to(root) for root in roots):
        raise _outside(where, roots)
    return resolved, info


def safetensors_files(path: str, roots: Sequence[Path] = ()) -> list[Path]:
    """The .safetensors files ``path`` names: itself, or those in its directory (an HF checkpoint,
    sharded or not, or a PEFT adapter directory), each with its symlinks followed and checked to be
    a regular file outside /proc, /sys and /dev, and under one of ``roots`` (resolved) when any
    are given; else INVALID_ARGUMENT naming ``path`` and the file. Nothing is opened here:
    ``Staging.read_file`` opens each without blocking and checks that it opened that file."""
    where = _shown_path(path)
    top, info = _resolve(Path(path), where, roots)
    if stat.S_ISDIR(info.st_mode):
        try:
            names = sorted(top.glob("*.safetensors"))
        except OSError as err:
            raise InvalidArgument(f"path: {where} cannot be listed on the server ({err.strerror})") from None
        if not names:
            raise InvalidArgument(f"path: {where} holds no .safetensors files")
        return [_regular_file(name, f"{where}: its file {name.name!r}", roots) for name in names]
    if Path(path).suffix == ".safetensors":
        return [_regular(Path(path), top, info, where)]
    raise InvalidArgument(f"path: {where} is neither a .safetensors file nor a directory on the server")


def no_tensors(path: str) -> InvalidArgument:
    """A LoadWeights of ``path`` whose files hold no tensor: refused, nothing changes."""
    where = _shown_path(path)
    return InvalidArgument(f"path: {where} holds no tensors (its .safetensors files are empty); nothing loaded")


def _regular_file(name: Path, where: str, roots: Sequence[Path]) -> Path:
    return _regular(name, *_resolve(name, where, roots), where)


def _regular(name: Path, resolved: Path, info: os.stat_result, where: str) -> Path:
    """``resolved`` (``name``'s symlinks followed), once ``info`` (its stat) shows a regular file."""
    if not stat.S_ISREG(info.st_mode):
        where += _leads_to(name, resolved)
        raise InvalidArgument(f"path: {where} is {_file_kind(info.st_mode)}, not a regular file")
    return resolved


def _leads_to(name: Path, resolved: Path) -> str:
    return "" if resolved == name else f" (it leads to {_shown_path(resolved)})"


def served_checkpoint_dirs(sources: Iterable[str]) -> list[Path]:
    """The local directories among the served models' ``sources`` (a checkpoint directory, or a
    LoRA model's ``BASE+ADAPTER_DIR``), resolved: LoadWeights may always read them again."""
    dirs = []
    for source in sources:
        for candidate in (source, source.partition("+")[2]):
            if candidate and os.path.isdir(os.path.expanduser(candidate)):
                dirs.append(Path(candidate).expanduser().resolve())
    return dirs
