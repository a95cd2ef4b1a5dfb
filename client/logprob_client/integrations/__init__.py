"""Integrations with trainers; each is an optional dependency, imported only when its module is.

``logprob_client.integrations.trl``: TRL's GRPOTrainer with the reference served remotely
(``pip install "logprob-service[trl]"``).
``logprob_client.integrations.verl``: verl's reference worker scoring with the service (an
engine in verl's EngineRegistry; ``pip install "logprob-service[verl]"``, docs/verl.md), and its
old-policy log-probs (``ServiceActorConfig``) with the actor's weights pushed by
``logprob_client.integrations.verl_checkpoint``, a verl CheckpointEngine plugin.
``logprob_client.integrations.openrlhf``: a drop-in for OpenRLHF's ReferenceModelActor and a
launcher that uses it (``pip install "logprob-service[openrlhf]"``, docs/openrlhf.md).
"""
