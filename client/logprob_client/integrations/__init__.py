"""Integrations with trainers; each is an optional dependency, imported only when its module is.

``logprob_client.integrations.trl``: TRL's GRPOTrainer with the reference served remotely
(``pip install "logprob-service[trl]"``).
"""
