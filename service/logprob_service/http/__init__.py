"""The HTTP edge: the log-prob calls trainers already make to vLLM, SGLang and TRL servers, answered
by the engine facade (docs/http.md). Like the gRPC edge (``api``) it converts, checks credentials
and maps errors; it imports no gRPC, protobuf or torch."""
