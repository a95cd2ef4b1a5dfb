"""What scoring work costs, in token-equivalents: the unit of the queue's budgets, of each
micro-batch's ``max_batch_tokens`` (``batch_queue``) and of admission's limits (``admission``).

An ordinary sequence of P + C tokens costs P + C, its attention included. A completion that
shares its prompt with others in a micro-batch (``worker.packing``) does not run the prompt again,
but its C rows still read the prompt's P keys and values (a gathered copy of them each): C x P key
reads that no token pays for. So a further completion of a shared prompt costs
C + ceil(C x P / ``KEYS_PER_TOKEN``), never more than it costs run alone (P + C). Admission also
counts a completion position's top-k and candidate outputs (``output_cost``), which the
micro-batches, cut by the tokens they run, do not.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from logprob_service.domain import TokenSequence

# One key read of a shared prompt costs 1/KEYS_PER_TOKEN of a token: near what the GPU measures
# (benchmarks/RESULTS.md, "Shared prompts"), and no heavier, since the micro-batch budget counts
# these costs and a group cut into more micro-batches runs its prompt again in each.
KEYS_PER_TOKEN = 4096

# This many top-k or candidate log-probs of a completion position count as one more token (admission
# only): 8 bytes each on the wire with their ids, and the kernel's top-k merges. An estimate that
# errs high: a token of a 0.5B model costs about 4x its lm_head, and K 256 at most ~1x.
OUTPUTS_PER_TOKEN = 256


def prompt_once(sequences: Iterable[TokenSequence]) -> Iterator[tuple[TokenSequence, int]]:
    """Each sequence with its share of the tokens ``sequences`` run together with shared prompts
    (``worker.packing``): its completion, plus its prompt where it is the first with that prompt.
    Lazy, so an edge can count a request's tokens while it builds its sequences."""
    seen: set[bytes] = set()
    for seq in sequences:
        yield seq, len(seq.completion_ids) + (0 if seq.prompt_key in seen else len(seq.prompt_ids))
        seen.add(seq.prompt_key)


def tokens_run(sequences: Sequence[TokenSequence]) -> int:
    """Tokens a micro-batch of ``sequences`` runs, each distinct prompt once (``worker.packing``);
    also what a request counts against ``max_tokens_per_request``."""
    return sum(cost for _, cost in prompt_once(sequences))


def shared_prompt_cost(seq: TokenSequence) -> int:
    """Token-equivalents of ``seq`` in a micro-batch that already runs its prompt: its completion,
    plus its reads of the prompt (``KEYS_PER_TOKEN``), never more than ``seq`` alone."""
    prompt, completion = len(seq.prompt_ids), len(seq.completion_ids)
    return completion + min(prompt, -(-completion * prompt // KEYS_PER_TOKEN))


def output_cost(seq: TokenSequence, top_k: int) -> int:
    """Token-equivalents of ``seq``'s top-k and candidate log-probs (``OUTPUTS_PER_TOKEN``)."""
    candidates = 0 if seq.candidate_ids is None else seq.candidate_ids.shape[1]
    return -(-len(seq.completion_ids) * (top_k + candidates) // OUTPUTS_PER_TOKEN)


def run_costs(sequences: Sequence[TokenSequence], *, share_prompts: bool = True) -> list[int]:
    """Each sequence's share, in token-equivalents, of what one micro-batch of ``sequences`` costs:
    with ``share_prompts`` (``worker.packing``), the first with its prompt costs its tokens, each
    further one ``shared_prompt_cost``; without, every sequence its tokens."""
    if not share_prompts:
        return [seq.num_tokens for seq in sequences]
    seen: set[bytes] = set()
    costs = []
    for seq in sequences:
        costs.append(shared_prompt_cost(seq) if seq.prompt_key in seen else seq.num_tokens)
        seen.add(seq.prompt_key)
    return costs
