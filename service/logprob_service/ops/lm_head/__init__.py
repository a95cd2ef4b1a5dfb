"""The fused lm_head: log-probs (and entropies, ranks, top-k, candidate log-probs) from hidden
states and the lm_head's weight in Triton kernels, without an [N, V] logits tensor.

One module a stage; the op is ``fused_logprobs.fused_token_logprobs``:

* ``fused_logprobs``: the plain pass (partials over vocabulary splits, then their combine), the op
* ``threshold``: the top-k's thresholds from a sample of the vocabulary, before the pass
* ``survivors``: stage 1, the keys at or above each row's threshold, kept during the pass
* ``repair``: the rounds that run stage 1 again for the rows whose slots missed their top-k
* ``selection``: stage 2, each row's K largest keys, decoded
* ``candidates``: the candidate ids' log-probs
* ``plans``: tiles, grid, and the top-k's sample, slots and row chunks
* ``keys``, ``tiles``: what the kernels share (the key encoding; tiles of logits, base-2 units)

The maths, stage by stage: docs/how-it-works.md, "The lm_head kernels, stage by stage".
"""
