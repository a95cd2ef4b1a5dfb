"""The wire protocol: generated protobuf and gRPC stubs of protos/logprob/v1/logprob.proto (`make proto`).

One package that both sides import: the client (`logprob_client`) and the server's gRPC edge
(`logprob_service.api`). Nothing else of the server sees protobuf.
"""
