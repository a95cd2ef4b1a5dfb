"""Integrations with trainers; each is an optional dependency, imported only when its module is.

``logprob_client.integrations.trl``: TRL's GRPOTrainer with the reference served remotely
(the ``[trl]`` extra: ``pip install trl==1.16.0``); ``.trl_teacher``: the service as the teacher
of TRL's ServerDistillationTrainer (docs/distillation.md).
``logprob_client.integrations.verl``: verl's reference worker scoring with the service (an
engine in verl's EngineRegistry; the ``[verl]`` extra, docs/verl.md), and its
old-policy log-probs (``ServiceActorConfig``) with the actor's weights pushed by
``logprob_client.integrations.verl_checkpoint``, a verl CheckpointEngine plugin.
``logprob_client.integrations.openrlhf``: a drop-in for OpenRLHF's ReferenceModelActor and a
launcher that uses it (the ``[openrlhf]`` extra, docs/openrlhf.md).

The package is on no index yet: install it from a checkout of this repository with the extra,
``pip install '.[trl]'``, or its wheel, ``pip install 'logprob_service-0.1.0-py3-none-any.whl[trl]'``.
"""
