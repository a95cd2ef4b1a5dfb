"""The one room that assembles the device side: above the engine, nothing else imports the
worker, the models or the ops (`make lint`).

- ``engine``: ``engine_on``, the one place a ``LogprobEngine`` gets its device workers and
  staging (a server's, an ``OfflineScorer``'s).
- ``models``: every model the settings name, on one device or one tensor-parallel rank.
- ``server``: ``DeviceSide``, a server's engine and its models loaded, a replica a device (data
  parallel) or sharded over a tensor-parallel group; the handles tests reach.
- ``in_process``: the model and the engine of an ``OfflineScorer``.

What start-up, ``OfflineScorer`` and the command line need of the device side is exported here:
the errors it raises (``ModelLoadError``, ``GroupLost``), and the types an in-process caller
passes and gets (``LogprobOp``, ``ScoringOptions``, ``ServedModel``, ``CausalLMScorer``).
"""

from logprob_service.builder.engine import cuda_version
from logprob_service.builder.in_process import InProcessModel, in_process_engine, serve_in_process
from logprob_service.builder.server import DeviceSide
from logprob_service.models.loading import ModelLoadError
from logprob_service.models.scorer import CausalLMScorer, ScoringOptions
from logprob_service.models.served import ServedModel
from logprob_service.ops.dispatch import LogprobOp
from logprob_service.worker.tensor_parallel import Build, GroupLost

__all__ = [
    "Build",
    "CausalLMScorer",
    "DeviceSide",
    "GroupLost",
    "InProcessModel",
    "LogprobOp",
    "ModelLoadError",
    "ScoringOptions",
    "ServedModel",
    "cuda_version",
    "in_process_engine",
    "serve_in_process",
]
