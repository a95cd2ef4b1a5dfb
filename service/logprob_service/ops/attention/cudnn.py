"""Causal varlen attention on packed rows through cuDNN's fused flash attention (cuDNN frontend).

The packed layout of ``ops.attention``: n sequences concatenated along the token axis,
delimited by ``cu_seqlens`` (int32 [n+1], 0 = c_0 <= c_1 <= ... <= c_n = T). Queries and keys may
be delimited differently (``cu_seqlens_q`` vs ``cu_seqlens_k``): sequence s owns query rows
[cq_s, cq_{s+1}) and key/value rows [ck_s, ck_{s+1}), with Lq_s <= Lk_s.

What is computed, for query row i (0-based within its sequence) and key row j of the same sequence::

    x_ij = scale * (q_i . k_j)                     # GQA: query head h reads key/value head h // (H / KV)
    allowed(i, j) = j <= i + (Lk - Lq)              # causal, aligned BOTTOM-RIGHT (as FlashAttention-2)
                    and j > i + (Lk - Lq) - w       # sliding window of w positions, self included (optional)
    o_i = sum_j softmax_j(x_ij over allowed j) v_j
    lse_i = log sum_{allowed j} exp(x_ij)           # natural log, float32, per query row and head

Bottom-right alignment makes a query chunk of a long sequence (its last Lq queries against the
layer's full K/V), and completions appended to a shared prompt, see exactly the keys they would
see in one causal pass. For Lq = Lk it is ordinary causal attention.

How it runs: one cuDNN SDPA graph per shape class, in the ragged (THD) layout. Q, K, V and O are
described to cuDNN as [n, heads, max_len, D] tensors with token-major strides; per-sequence
*ragged offsets* (the element offset of each sequence's first row, ``cu * heads * D``) replace the
batch stride, and per-sequence *lengths* (``cu[s+1] - cu[s]``) drive the padding mask and the
bottom-right diagonal. Both are computed from ``cu_seqlens`` on the device (no host sync). GQA is
native (K/V keep their KV heads). Kernels come from the libcudnn that torch already loaded.
Variable lengths need cuDNN's padding mask; its kernel runs a few percent behind the mask-free one
that torch's SDPA picks for dense [B, H, L, D] inputs (``benchmarks/bench_attention.py`` measures
both), which is the price of packing without padding.

Graph cache. Building a cuDNN graph (validate, heuristics, plan compilation) costs tens to
hundreds of milliseconds, far more than running it, so built graphs are cached under everything
that shapes them: device, dtype, heads, KV heads, head dim, the number of sequences, max query
length and max key length, each rounded UP to a power of two (``_bucket``), the mask (causal,
sliding window w, or full), the softmax scale (a graph constant), and whether the lse is produced.
Rounding up is exact: the padding sequences have length 0 (ragged offset = T, nothing read or
written) and a larger max length only adds thread blocks that find no rows and exit, so one graph
serves every batch of its class and the cache stays small (about log2 of each range). The total
token count does not shape a ragged graph (offsets arrive as data), so it is not in the key. A key
that cuDNN refuses is cached too, with its reason, so a refused shape is not rebuilt on every call.

Precondition the kernels cannot check without a host sync: ``max_q`` / ``max_k`` must be at least
the longest query / key sequence, and every sequence needs Lq <= Lk.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any, NamedTuple

import torch

from logprob_service.ops.attention.common import FLASH_DTYPES

__all__ = [
    "CUDNN_FRONTEND_PACKAGE",
    "available",
    "clear_graph_cache",
    "cudnn_blocker",
    "cudnn_varlen_attention",
    "graph_build_seconds",
]

CUDNN_FRONTEND_PACKAGE = "nvidia-cudnn-frontend"

MIN_BACKEND_VERSION = 90600
"""cuDNN 9.6: bottom-right causal masks with lengths that are not multiples of 64, and with a
sliding window on sequences whose query and key lengths differ (cudnn-frontend's support surface)."""

MAX_HEAD_DIM = 256

_MIN_LENGTH_BUCKET = 64  # below this, extra empty thread blocks cost nothing worth another graph
_MIN_BATCH_BUCKET = 8


class _Uid:
    """Tensor ids of the graph's variant pack (plain ints: the frontend's execute wants int keys)."""

    Q = 1
    K = 2
    V = 3
    OUT = 4
    LSE = 5
    SEQ_LEN_Q = 10
    SEQ_LEN_K = 11
    OFFSETS_Q = 20  # of Q and O (same heads x head dim per row)
    OFFSETS_K = 21  # of K and V
    OFFSETS_LSE = 22


class _Key(NamedTuple):
    """Everything that shapes a graph (see the module docstring)."""

    device: int
    dtype: torch.dtype
    heads: int
    kv_heads: int
    head_dim: int
    batch: int  # sequences, bucketed
    max_q: int  # bucketed
    max_k: int  # bucketed
    mask: str  # "causal" | "window" | "full"
    window: int  # w for "window", else 0
    scale: float
    lse: bool


class _Graph(NamedTuple):
    graph: Any  # cudnn.pygraph
    workspace_bytes: int
    build_seconds: float


_lock = threading.Lock()
_graphs: dict[_Key, _Graph | str] = {}  # a str: why cuDNN refused the key
_handles: dict[int, Any] = {}  # device index -> cuDNN handle
_handle_streams: dict[int, int] = {}  # device index -> the stream its handle was last set to


# --------------------------------------------------------------------------- loading


@functools.cache
def _load() -> tuple[Any | None, str | None]:
    """(the ``cudnn`` module, None), or (None, why not). Imported lazily: CPU machines and images
    without the package import this module all the same.

    How libcudnn is found: ``import torch`` has already loaded torch's own libcudnn (libtorch_cuda
    links it; on pip builds it lives in the ``nvidia-cudnn-cu*`` wheel under site-packages). The
    frontend then dlopens ``<purelib>/nvidia/cudnn/lib/libcudnn.so.9``, the same file, or falls
    back to ``dlopen("libcudnn.so.9")``, which the dynamic loader answers with the library already
    loaded under that soname. Either way one cuDNN serves torch and the frontend.
    """
    if not torch.cuda.is_available():
        return None, "no CUDA device"
    torch.backends.cudnn.version()  # make sure torch's libcudnn is loaded before the frontend looks
    try:
        import cudnn
    except ImportError as exc:
        return None, f"{CUDNN_FRONTEND_PACKAGE} not installed ({exc})"
    except OSError as exc:  # the package is there but its library could not be loaded
        return None, f"{CUDNN_FRONTEND_PACKAGE} could not load libcudnn ({exc})"
    version = int(cudnn.backend_version())
    if version < MIN_BACKEND_VERSION:
        return None, f"cuDNN {version} older than {MIN_BACKEND_VERSION} (bottom-right causal masks)"
    return cudnn, None


def available() -> bool:
    """Whether the cuDNN frontend is importable here, on a CUDA machine with a recent enough cuDNN."""
    return _load()[0] is not None


@functools.cache
def _compute_capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def cudnn_blocker(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    window_size: tuple[int, int] = (-1, 0),
    softcap: float | None = None,
) -> str | None:
    """None when ``cudnn_varlen_attention`` can compute this call exactly, else the reason it cannot.

    q: [Tq, H, D]; k, v: [Tk, KV, D] (or any layout whose last two dims are heads, head dim).
    ``window_size``: flash attention's inclusive (left, right) window: (-1, 0) causal, (w - 1, 0)
    causal with a sliding window of w positions, (-1, -1) full (non-causal). cuDNN may still refuse
    a graph that passes these checks: ``cudnn_varlen_attention`` then raises NotImplementedError.
    """
    if q.device.type != "cuda":
        return "a device other than CUDA"
    if softcap is not None:
        # cuDNN's SDPA node has no softcap attribute; a score_mod subgraph could express tanh, but
        # cuDNN then disables its own padding and causal masks, which packed rows need.
        return "attention softcapping (cuDNN's SDPA has no softcap)"
    left, right = window_size
    if not (right == 0 and left >= -1) and (left, right) != (-1, -1):
        return f"window_size {window_size} (only causal, causal sliding window, or full attention)"
    cudnn, reason = _load()
    if cudnn is None:
        return reason
    if q.dtype not in FLASH_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtypes {q.dtype}/{k.dtype}/{v.dtype} (cuDNN flash attention runs float16/bfloat16 only)"
    head_dim = q.shape[-1]
    if k.shape[-1] != head_dim or v.shape[-1] != head_dim:
        return "value/key head dims differing from the query's"
    if head_dim % 8 != 0 or head_dim > MAX_HEAD_DIM:
        return f"head dim {head_dim} (cuDNN needs a multiple of 8, at most {MAX_HEAD_DIM})"
    if k.shape[-2] != v.shape[-2] or q.shape[-2] % k.shape[-2] != 0:
        return f"{q.shape[-2]} query heads not a multiple of {k.shape[-2]} key/value heads"
    capability = _compute_capability(_device_index(q.device))
    if capability < (9, 0) and int(cudnn.backend_version()) < 91801:
        return "a GPU older than Hopper (cuDNN < 9.18.1 runs ragged layouts on sm90+ only)"
    if capability < (8, 0):
        return "a GPU older than compute capability 8.0"
    return None


# --------------------------------------------------------------------------- graphs


def _bucket(x: int, floor: int) -> int:
    """The power of two at or above max(x, floor)."""
    return 1 << (max(x, floor) - 1).bit_length()


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _handle(cudnn: Any, index: int) -> Any:
    handle = _handles.get(index)
    if handle is None:
        with _lock, torch.cuda.device(index):
            handle = _handles.get(index)
            if handle is None:
                handle = _handles[index] = cudnn.create_handle()
    return handle


def _graph(cudnn: Any, key: _Key, handle: Any) -> _Graph:
    entry = _graphs.get(key)
    if entry is None:
        with _lock:
            entry = _graphs.get(key)
            if entry is None:
                start = time.perf_counter()
                try:
                    with torch.cuda.device(key.device):
                        graph = _build(cudnn, key, handle)
                        entry = _Graph(graph, int(graph.get_workspace_size()), time.perf_counter() - start)
                except Exception as exc:  # cuDNN says "not supported" with several exception types
                    entry = f"cuDNN refused {_describe(key)}: {type(exc).__name__}: {exc}"
                _graphs[key] = entry
    if isinstance(entry, str):
        raise NotImplementedError(entry)
    return entry


def _describe(key: _Key) -> str:
    mask = f"window {key.window}" if key.mask == "window" else key.mask
    return (
        f"{str(key.dtype).removeprefix('torch.')} H={key.heads} KV={key.kv_heads} D={key.head_dim} "
        f"n<={key.batch} max_q<={key.max_q} max_k<={key.max_k} {mask}{' +lse' if key.lse else ''}"
    )


def _build(cudnn: Any, key: _Key, handle: Any) -> Any:
    """A ragged (THD) SDPA forward graph for ``key``, planned and compiled."""
    io_type = cudnn.data_type.HALF if key.dtype == torch.float16 else cudnn.data_type.BFLOAT16
    b, h, kv, d, sq, sk = key.batch, key.heads, key.kv_heads, key.head_dim, key.max_q, key.max_k
    graph = cudnn.pygraph(
        io_data_type=io_type,
        intermediate_data_type=cudnn.data_type.FLOAT,
        compute_data_type=cudnn.data_type.FLOAT,
        handle=handle,
    )

    def per_sequence(name: str, uid: int, rows: int, dtype: Any) -> Any:  # [rows, 1, 1, 1] on the device
        return graph.tensor(name=name, dim=[rows, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dtype, uid=uid)

    # Token-major rows: logical [b, heads, s, d] with row stride heads*d; the batch stride is
    # replaced by the ragged offsets (element offset of each sequence's first row).
    offsets_q = per_sequence("offsets_q", _Uid.OFFSETS_Q, b + 1, cudnn.data_type.INT64)
    offsets_k = per_sequence("offsets_k", _Uid.OFFSETS_K, b + 1, cudnn.data_type.INT64)
    q = graph.tensor(name="q", dim=[b, h, sq, d], stride=[sq * h * d, d, h * d, 1], data_type=io_type, uid=_Uid.Q)
    k = graph.tensor(name="k", dim=[b, kv, sk, d], stride=[sk * kv * d, d, kv * d, 1], data_type=io_type, uid=_Uid.K)
    v = graph.tensor(name="v", dim=[b, kv, sk, d], stride=[sk * kv * d, d, kv * d, 1], data_type=io_type, uid=_Uid.V)
    q.set_ragged_offset(offsets_q)
    k.set_ragged_offset(offsets_k)
    v.set_ragged_offset(offsets_k)

    mask: dict[str, Any] = {}
    if key.mask != "full":
        mask = {"diagonal_alignment": cudnn.diagonal_alignment.BOTTOM_RIGHT, "diagonal_band_right_bound": 0}
        if key.mask == "window":
            # cuDNN keeps key j iff j > i' - left_bound (i' the bottom-right aligned diagonal):
            # exactly transformers' window of w positions, self included.
            mask["diagonal_band_left_bound"] = key.window
    o, lse = graph.sdpa(
        name="sdpa",
        q=q,
        k=k,
        v=v,
        attn_scale=key.scale,
        generate_stats=key.lse,
        use_padding_mask=True,
        seq_len_q=per_sequence("seq_len_q", _Uid.SEQ_LEN_Q, b, cudnn.data_type.INT32),
        seq_len_kv=per_sequence("seq_len_k", _Uid.SEQ_LEN_K, b, cudnn.data_type.INT32),
        compute_data_type=cudnn.data_type.FLOAT,
        **mask,
    )
    o.set_output(True).set_dim([b, h, sq, d]).set_stride([sq * h * d, d, h * d, 1]).set_data_type(io_type)
    o.set_uid(_Uid.OUT)
    o.set_ragged_offset(offsets_q)
    if key.lse:
        # float32 [T, H] written in place: logical [b, h, s, 1] with row stride h, offsets cu * h.
        lse.set_output(True).set_dim([b, h, sq, 1]).set_stride([sq * h, 1, h, 1])
        lse.set_data_type(cudnn.data_type.FLOAT).set_uid(_Uid.LSE)
        lse.set_ragged_offset(per_sequence("offsets_lse", _Uid.OFFSETS_LSE, b + 1, cudnn.data_type.INT64))

    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    return graph


def graph_build_seconds() -> dict[str, float]:
    """Seconds each cached graph took to build, by a readable description of its key."""
    return {_describe(key): entry.build_seconds for key, entry in list(_graphs.items()) if isinstance(entry, _Graph)}


def clear_graph_cache() -> None:
    """Forget every built (or refused) graph; the next calls rebuild."""
    with _lock:
        _graphs.clear()


# --------------------------------------------------------------------------- attention


def _window_mask(window_size: tuple[int, int]) -> tuple[str, int]:
    left, right = window_size
    if right == -1:
        return "full", 0
    return ("causal", 0) if left == -1 else ("window", left + 1)  # flash's (w - 1, 0) is w positions


def _padded_cu(cu: torch.Tensor, batch: int) -> torch.Tensor:
    """int32 [batch + 1]: ``cu``, then its last entry again for each empty padding sequence."""
    cu = cu.to(torch.int32)  # a no-op for the int32 boundaries callers pass
    extra = batch + 1 - cu.numel()
    return torch.cat((cu, cu[-1:].expand(extra))) if extra else cu


_row_elements: dict[tuple[int, int, int, int], torch.Tensor] = {}  # (device, H, KV, D) -> int64 [3, 1]


def _ragged_inputs(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, key: _Key) -> dict[int, torch.Tensor]:
    """Per-sequence lengths (int32 [batch]) and ragged offsets (int64 [batch + 1], in elements) on
    the device: two to four small kernels, no host sync. Offsets are cu * (elements per row):
    H*D for Q and O, KV*D for K and V, H for the lse."""
    sizes = _row_elements.get((key.device, key.heads, key.kv_heads, key.head_dim))
    if sizes is None:  # made once per shape: a host-to-device copy per call would cost more than the math
        per_row = [key.heads * key.head_dim, key.kv_heads * key.head_dim, key.heads]
        sizes = torch.tensor(per_row, dtype=torch.int64, device=f"cuda:{key.device}")[:, None]
        _row_elements[(key.device, key.heads, key.kv_heads, key.head_dim)] = sizes
    cu_q = _padded_cu(cu_seqlens_q, key.batch)
    seq_q = cu_q[1:] - cu_q[:-1]  # int32 [batch]
    if cu_seqlens_k is cu_seqlens_q:  # self-attention: one multiply gives all three offset rows
        offsets_q, offsets_k, offsets_lse = sizes * cu_q  # int64 [3, batch + 1], each row contiguous
        seq_k = seq_q
    else:
        offsets_q, offsets_lse = sizes[0::2] * cu_q  # [2, batch + 1]
        cu_k = _padded_cu(cu_seqlens_k, key.batch)
        offsets_k, seq_k = sizes[1] * cu_k, cu_k[1:] - cu_k[:-1]
    inputs = {
        _Uid.SEQ_LEN_Q: seq_q,
        _Uid.SEQ_LEN_K: seq_k,
        _Uid.OFFSETS_Q: offsets_q,
        _Uid.OFFSETS_K: offsets_k,
    }
    if key.lse:
        inputs[_Uid.OFFSETS_LSE] = offsets_lse
    return inputs


def cudnn_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    scale: float,
    window_size: tuple[int, int] = (-1, 0),
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of each packed sequence's queries over its keys (see the module docstring).

    q: [Tq, H, D]; k, v: [Tk, KV, D] (H a multiple of KV), float16/bfloat16 on CUDA.
    cu_seqlens_q / cu_seqlens_k: int32 [n+1] on q's device. max_q / max_k: host ints at least the
    longest query / key sequence (they pick the graph; no host sync happens here).
    window_size: (-1, 0) causal (bottom-right), (w - 1, 0) causal with a window of w positions,
    (-1, -1) full (non-causal; e.g. a query chunk against a prefix it sees entirely).
    Returns out [Tq, H, D] in q's dtype, and with ``return_lse`` also lse [Tq, H] float32 (natural
    log of the sum over allowed keys of exp(scale * q.k), per query row and head).
    Raises NotImplementedError with the reason when ``cudnn_blocker`` objects or cuDNN refuses.
    """
    reason = cudnn_blocker(q, k, v, window_size=window_size)
    if reason is not None:
        raise NotImplementedError(f"cuDNN varlen attention cannot run: {reason}")
    cudnn, _ = _load()
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # no-ops for the usual [T, heads, D] tensors
    total_q, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    out = torch.empty_like(q)  # [Tq, H, D]
    lse = q.new_empty(total_q, heads, dtype=torch.float32) if return_lse else None  # [Tq, H]
    n = cu_seqlens_q.numel() - 1
    if n > 0 and total_q > 0:
        device = q.device
        index = _device_index(device)
        mask, window = _window_mask(window_size)
        key = _Key(
            device=index,
            dtype=q.dtype,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            batch=_bucket(n, _MIN_BATCH_BUCKET),
            max_q=_bucket(int(max_q), _MIN_LENGTH_BUCKET),
            max_k=_bucket(int(max_k), _MIN_LENGTH_BUCKET),
            mask=mask,
            window=window,
            scale=float(scale),
            lse=return_lse,
        )
        handle = _handle(cudnn, index)
        entry = _graph(cudnn, key, handle)

        pack = {_Uid.Q: q, _Uid.K: k, _Uid.V: v, _Uid.OUT: out, **_ragged_inputs(cu_seqlens_q, cu_seqlens_k, key)}
        if lse is not None:
            pack[_Uid.LSE] = lse
        # Temporaries (workspace, offsets) are freed to torch's caching allocator when this returns;
        # it hands their memory out again only in stream order, after the kernel has read them.
        workspace = torch.empty(max(entry.workspace_bytes, 1), dtype=torch.uint8, device=device)
        _execute(cudnn, entry.graph, handle, index, pack, workspace)
    return (out, lse) if lse is not None else out


def _execute(cudnn: Any, graph: Any, handle: Any, index: int, pack: dict[int, torch.Tensor], workspace: Any) -> None:
    stream = torch.cuda.current_stream(index).cuda_stream
    # One handle per device carries one stream: setting it and enqueueing must not interleave
    # with another thread's call on another stream.
    with _lock:
        if _handle_streams.get(index) != stream:
            cudnn.set_stream(handle=handle, stream=stream)
            _handle_streams[index] = stream
        if torch.cuda.current_device() != index:
            with torch.cuda.device(index):
                graph.execute(pack, workspace, handle=handle)
        else:
            graph.execute(pack, workspace, handle=handle)
