"""logprob-service: a GPU-resident gRPC service that scores token log-probabilities."""

__version__ = "0.1.0"
