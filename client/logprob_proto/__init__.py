"""The wire protocol: generated protobuf and gRPC stubs of protos/logprob/v1/logprob.proto (`make proto`),
and the UpdateWeights framing both sides use (`framing.py`: the client writes tensor pieces with it,
the server's edge reads them).

One package that both sides import: the client (`logprob_client`) and the server's gRPC edge
(`logprob_service.api`). Nothing else of the server sees protobuf.
"""
