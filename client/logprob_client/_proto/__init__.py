"""Generated gRPC stubs of protos/logprob/v1/logprob.proto (make proto)."""
