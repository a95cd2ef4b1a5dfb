"""Split sequences into micro-batches of balanced token counts.

RL trainers send sequences of wildly different lengths (a 30-token refusal next to a 4k-token
chain of thought). Under a token budget, greedy filling leaves the last micro-batches small, so
forward passes differ in size and the GPU sits idle on the short ones. Like verl's "dynamic batch
size" (``rearrange_micro_batches`` in ``verl/utils/seqlen_balancing.py``), we instead pick a number
of micro-batches k and split the sequences into k parts of nearly equal token sums with the
Karmarkar-Karp largest differencing method, so every forward pass does about the same work.
Unlike verl, k is raised until every part actually fits the budget.

KK costs O(n k log k), and the plan runs on the event loop before admission, refused requests
included: 4,096 sequences in 1,021 parts took 8 s on the 2-core CPU machine, every other caller
waiting. Past ``KK_MAX_WORK`` (n x k) the parts come from longest-first instead (LPT, O(n log n)),
whose many small items in many parts balance nearly as well. Either is computed in slices
(``slices.Steps``): the scheduler hands the event loop back between them.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from logprob_service.engine.slices import Budget, Steps, finish

# A part: (sum of its weights, indices of its items). A partial partition: k parts sorted by
# decreasing sum (ties: more items first, then by indices), so [0] is the largest, [-1] the smallest.
WeightedSubset = tuple[int, tuple[int, ...]]
# Items x parts up to which KK plans (about 20 ms on the 2-core CPU machine; a request of 1,024
# sequences in 16 micro-batches, as the defaults cut a GRPO step's RPC, is planned by KK).
KK_MAX_WORK = 1 << 14


def _entry(parts: Sequence[WeightedSubset], order: int) -> tuple[int, int, tuple[WeightedSubset, ...]]:
    """A heap entry: (-spread, creation order, partition). The order is unique, so partitions
    themselves are never compared and ties in spread go to the older partition."""
    ordered = tuple(sorted(parts, key=lambda p: (-p[0], -len(p[1]), p[1])))
    return ordered[-1][0] - ordered[0][0], order, ordered


def karmarkar_karp(weights: Sequence[int], k: int) -> list[list[int]]:
    """Partition the indices ``0..n-1`` into exactly ``k`` parts of nearly equal weight sums.

    The k-way largest differencing method (LDM) of Karmarkar and Karp (1982): start from n
    partial partitions, item i alone in one part and k - 1 empty parts. Its *spread* is
    max sum - min sum. Repeatedly take the two partial partitions A, B of largest spread and
    merge them into one, joining A's i-th largest part with B's i-th smallest,

        C_i = A_i ∪ B_{k-1-i}    (A, B sorted by decreasing sum),

    which cancels most of both spreads, until one partition is left. Each merge costs
    O(k log k) and there are n - 1 of them, O(n k log k + n log n) in all.

    Worst case (minimising the largest sum, weights >= 0): at most (4/3 - 1/(3k)) * OPT, and
    some instances reach 4/3 - 1/(3(k-1)) (Michiels, Korst, Aarts, van Leeuwen 2007); for k = 2
    the bound is the tight 7/6 (Fischetti and Martello 1987). On random inputs it typically does
    much better than that, and better than greedy longest-first (LPT).

    Deterministic: ties in spread go to the partition built first (single items by index).
    Parts come out by decreasing sum, each as sorted indices; with n < k some are empty.
    """
    return finish(karmarkar_karp_steps(weights, k))


def karmarkar_karp_steps(weights: Sequence[int], k: int) -> Steps[list[list[int]]]:
    """``karmarkar_karp`` as ``slices.Steps``, a slice ending every few merges."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    empty: WeightedSubset = (0, ())
    budget = Budget()
    heap = []
    for i, w in enumerate(weights):
        heap.append(_entry([(w, (i,))] + [empty] * (k - 1), i))
        if budget.spent(k):
            yield
    heapq.heapify(heap)
    for order in range(len(heap), 2 * len(heap) - 1):
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b))]
        heapq.heappush(heap, _entry(merged, order))
        if budget.spent(2 * k):  # a merge: its k parts joined, sorted and their spread taken
            yield
    parts = heap[0][2] if heap else (empty,) * k
    return [sorted(indices) for _, indices in parts]


def longest_first(weights: Sequence[int], k: int) -> list[list[int]]:
    """Partition the indices ``0..n-1`` into exactly ``k`` parts: each item, heaviest first (ties:
    lower index first), into the part of smallest sum so far (ties: fewer items, then lower part,
    so that items of no weight spread too). Graham's LPT,
    O(n log n + n log k), at most (4/3 - 1/(3k)) * OPT. Deterministic; parts come out by
    decreasing sum, each as sorted indices; with n < k some are empty."""
    return finish(longest_first_steps(weights, k))


def longest_first_steps(weights: Sequence[int], k: int) -> Steps[list[list[int]]]:
    """``longest_first`` as ``slices.Steps``, a slice ending every few hundred items."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    budget = Budget()
    parts: list[list[int]] = [[] for _ in range(k)]
    loads = [(0, 0, j) for j in range(k)]
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        load, count, j = heapq.heappop(loads)
        parts[j].append(i)
        heapq.heappush(loads, (load + weights[i], count + 1, j))
        if budget.spent(2):
            yield
    by_sum = sorted(loads, key=lambda entry: (-entry[0], -entry[1], entry[2]))
    return [sorted(parts[j]) for _, _, j in by_sum]


def plan_micro_batches(
    lengths: Sequence[int], *, max_tokens: int, max_sequences: int, sizes: Sequence[int] | None = None
) -> list[list[int]]:
    """Group sequence indices into micro-batches of at most ``max_tokens`` tokens and at most
    ``max_sequences`` sequences, as few as Karmarkar-Karp balancing allows.

    An item may stand for several sequences always scored together (``sizes[i]`` of them, default
    1: a prompt group, its length the tokens it runs); the counts below are of sequences. A
    sequence longer than ``max_tokens`` cannot be split, so it forms a micro-batch of its own (so
    does an item over either limit).
    The other n sequences, with T tokens in all, need at least

        k0 = max(ceil(T / max_tokens), ceil(n / max_sequences))

    micro-batches. From k = k0 up, partition them with :func:`karmarkar_karp` (with
    :func:`longest_first` once n x k passes ``KK_MAX_WORK``) and keep the first k whose parts all
    fit. Both balance token sums, not counts, so k may have to grow past k0; at k = n every
    sequence is alone and fits, so the search ends. (The fewest k for which KK fits,
    not necessarily the fewest possible: that is bin packing, NP-hard.)

    Returns lists of indices, each sorted, none empty, ordered by their first index.
    """
    return finish(plan_micro_batches_steps(lengths, max_tokens=max_tokens, max_sequences=max_sequences, sizes=sizes))


def plan_micro_batches_steps(
    lengths: Sequence[int], *, max_tokens: int, max_sequences: int, sizes: Sequence[int] | None = None
) -> Steps[list[list[int]]]:
    """``plan_micro_batches`` as ``slices.Steps``: a slice ends every few hundred items or merges."""
    if max_tokens < 1 or max_sequences < 1:
        raise ValueError(f"max_tokens and max_sequences must be >= 1, got {max_tokens} and {max_sequences}")
    sizes = [1] * len(lengths) if sizes is None else sizes
    batches = [[i] for i, n in enumerate(lengths) if n > max_tokens or sizes[i] > max_sequences]
    rest = [i for i, n in enumerate(lengths) if n <= max_tokens and sizes[i] <= max_sequences]
    weights = [lengths[i] for i in rest]
    counts = [sizes[i] for i in rest]
    k0 = max(-(-sum(weights) // max_tokens), -(-sum(counts) // max_sequences), 1)
    for k in range(k0, len(rest)):
        split = karmarkar_karp_steps if len(weights) * k <= KK_MAX_WORK else longest_first_steps
        parts = [p for p in (yield from split(weights, k)) if p]
        yield
        if all(sum(counts[j] for j in p) <= max_sequences and sum(weights[j] for j in p) <= max_tokens for p in parts):
            batches += [[rest[j] for j in p] for p in parts]
            break
    else:
        batches += [[i] for i in rest]
    return sorted(batches)
