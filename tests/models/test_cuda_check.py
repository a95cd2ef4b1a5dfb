"""A server that cannot start CUDA says why: torch's CUDA version, the driver's, and the fix."""

from __future__ import annotations

import logging

import pytest
import torch
from logprob_service.models import cuda_check
from logprob_service.models.loading import ModelLoadError, resolve_devices

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA starts here")


def test_the_driver_version_is_read_from_the_kernel_modules_file(tmp_path, monkeypatch):
    version = tmp_path / "version"
    version.write_text(
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build  (dvs-builder@U16)\n"
        "GCC version:  gcc version 12.3.0\n"
    )
    assert cuda_check.driver_version(version) == "570.86.15"
    monkeypatch.setattr(cuda_check.shutil, "which", lambda name: None)
    assert cuda_check.driver_version(tmp_path / "absent") is None


def test_an_old_driver_is_named_with_torchs_cuda_and_the_fix():
    message = cuda_check.why_cuda_unusable(driver="535.104.05", cuda="12.8")
    assert "built for CUDA 12.8, which needs an NVIDIA driver >= 570.26" in message
    assert "driver 535.104.05" in message
    assert "TORCH_CUDA=cu126" in message and "--device cpu" in message


def test_no_driver_says_so_and_how_to_give_the_container_a_gpu(monkeypatch):
    monkeypatch.setattr(cuda_check, "driver_version", lambda: None)
    message = cuda_check.why_cuda_unusable(cuda="13.0")
    assert "built for CUDA 13.0, which needs an NVIDIA driver >= 580.65.06" in message
    assert "no NVIDIA driver found" in message and "--gpus all" in message


@needs_no_cuda
def test_device_cuda_is_refused_where_cuda_cannot_start():
    with pytest.raises(ModelLoadError, match=r"device 'cuda' asked for, but CUDA cannot start here: .*Fix: "):
        resolve_devices("cuda")
    with pytest.raises(ModelLoadError, match="CUDA cannot start here"):
        resolve_devices("cuda:1")


@needs_no_cuda
def test_auto_falls_back_to_the_cpu_with_a_warning_saying_why(caplog):
    with caplog.at_level(logging.WARNING, logger="logprob_service"):
        assert resolve_devices("auto") == [torch.device("cpu")]
    (record,) = [r for r in caplog.records if r.name.startswith("logprob_service")]
    assert record.levelno == logging.WARNING
    assert "serving on the CPU at float32, no GPU" in record.getMessage()
    assert "Fix: " in record.getMessage()
