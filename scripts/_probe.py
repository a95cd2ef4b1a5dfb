import importlib

import torch

for m in [
    "transformers",
    "grpc",
    "google.protobuf",
    "triton",
    "numpy",
    "prometheus_client",
    "safetensors",
    "peft",
    "yaml",
    "pytest",
]:
    try:
        mod = importlib.import_module(m)
        print(m, getattr(mod, "__version__", "?"))
    except Exception as e:
        print(m, "MISSING", e)
print("torch", torch.__version__, torch.cuda.get_device_name())
a = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
b = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
try:
    c = torch.mm(a, b, out_dtype=torch.float32)
    ref = a.double() @ b.double()
    print(
        "mm out_dtype ok",
        c.dtype,
        (c.double() - ref).abs().max().item(),
        "bf16 out err",
        ((a @ b).double() - ref).abs().max().item(),
    )
except Exception as e:
    print("mm out_dtype FAIL", e)
try:
    print("varlen ok")
except Exception as e:
    print("varlen missing", e)
print("AttentionInterface ok")
