# syntax=docker/dockerfile:1
# logprob-service for a GPU node. Build: `docker build -t logprob-service .`; run: README, "Docker".
#
# One stage on a CUDA runtime base: apt's Python and C compiler (Triton builds its launcher at run
# time, so the running image needs them too), then the project installed into /opt/venv by
# scripts/install.sh, the script `make install` runs, and so CI: each CI run exercises these
# install steps. The install reads the build context through a mount and leaves no source tree, pip
# cache or build files in the image. It runs as a non-root user and is configured through LOGPROB_*
# environment variables (or flags after the image name, which `logprob-service serve` receives).

# The CUDA line of the image: PyTorch's wheel line (TORCH_CUDA, below) and the base image's CUDA
# go together, since the NVIDIA container toolkit refuses to start a container whose base asks for
# a newer CUDA than the node's driver has. Each line's minimum driver (docs/deployment.md, "GPU
# drivers"): cu126 (CUDA 12.6) R560, cu128 (12.8, the default) R570, cu130 (13.0) R580; R535 and
# R550 run the 12.x lines through CUDA's minor-version compatibility. cu128 is the oldest line that
# covers Blackwell (sm_100, sm_120) as well as Hopper (sm_90). Another line, e.g. for an R560 node:
#   docker build --build-arg TORCH_CUDA=cu126 \
#     --build-arg CUDA_IMAGE=docker.io/nvidia/cuda:12.6.3-runtime-ubuntu24.04 -t logprob-service .
# Fully qualified: podman and buildah resolve a short name (nvidia/cuda) only through the
# registries.conf of the machine, which may name no registry (Debian's podman: "short-name did not
# resolve"); docker.io/ is what docker reads the short name as.
ARG CUDA_IMAGE=docker.io/nvidia/cuda:12.8.1-runtime-ubuntu24.04

FROM ${CUDA_IMAGE}
# An ARG, not an ENV: apt needs it while building, the running image does not.
ARG DEBIAN_FRONTEND=noninteractive
# python3-dev and gcc: at the first call of a Triton kernel (the fused log-prob op), Triton builds
# its small launcher with the system C compiler against Python's headers.
# Unpinned apt packages (DL3008): they follow the base image's Ubuntu release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# torch from PyTorch's index of one CUDA line (TORCH_CUDA): its wheels carry their own CUDA
# libraries, and the node's driver, which the NVIDIA container toolkit mounts, must support that
# line. (PyPI's Linux wheel is the newest line, CUDA 13, which needs R580.) TORCH_INDEX empty: pip's
# own indexes (CI's CPU build, scripts/build-image.sh with BASE=debian).
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_CUDA=cu128
ARG TORCH_INDEX=https://download.pytorch.org/whl/${TORCH_CUDA}
# The project's extras: server, and gpu (nvidia-cudnn-frontend, cuDNN's ragged attention for packed
# rows; ops/attention/cudnn.py). The server starts without gpu's packages and imports them only on
# a CUDA device, and their wheels install on any Linux x86_64, so CI's image test (BASE=debian, CPU
# torch) builds this default as it is: the GPU image's own install step, resolved with every
# dependency it brings (~0.2 GB of wheels). --build-arg EXTRAS=server leaves them out.
ARG EXTRAS=server,gpu
# The build context (what .dockerignore lets in: pyproject.toml, README.md, scripts/install.sh,
# client/, service/) is mounted read-only at /mnt for this step alone and copied to /tmp/src, where
# setuptools writes its build files; the copy goes in the same step, so no layer holds it.
# One stage, not a build stage whose venv a final stage copies: the venv (1.8 GB with CPU torch) is
# written and committed once, not twice. Measured with CPU torch and podman on a CI machine: the
# build's peak disk use fell from 10.3 to 9.3 GB, 2 builds each (most of it committing the layer).
RUN --mount=type=bind,target=/mnt \
    cp -r /mnt /tmp/src \
    && PIP_NO_CACHE_DIR=1 VENV=/opt/venv PYTHON=python3 TORCH_SPEC="${TORCH_SPEC}" TORCH_INDEX="${TORCH_INDEX}" \
    EXTRAS="${EXTRAS}" EDITABLE=0 \
    /tmp/src/scripts/install.sh \
    && rm -rf /tmp/src

RUN groupadd --gid 10001 logprob \
    && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin logprob \
    && mkdir -p /data/models /data/hf /data/cache \
    && chown -R 10001:10001 /data
# /data: model checkpoints (/data/models), the Hugging Face cache (HF_HOME) and Triton's kernel
# cache, kept across restarts when /data is a volume.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/data/hf \
    TRITON_CACHE_DIR=/data/cache/triton \
    LOGPROB_DEVICE=cuda \
    LOGPROB_HOST=0.0.0.0 \
    LOGPROB_PORT=50051 \
    LOGPROB_HTTP_PORT=8000 \
    LOGPROB_METRICS_PORT=9481
VOLUME ["/data"]
WORKDIR /data
USER 10001:10001
# gRPC, the HTTP edge (vLLM / SGLang / TRL callers, docs/http.md; vLLM's port), and Prometheus /metrics.
EXPOSE 50051 8000 9481
# LOGPROB_DEVICE=cuda: every GPU the container is given, and a start that fails, saying why (the
# driver, torch's CUDA), where CUDA cannot start, rather than scoring on the CPU. -e LOGPROB_DEVICE=cpu
# serves on the CPU on purpose.
# The standard gRPC health service: healthy once the models are loaded and warm; `probe` reads the
# same LOGPROB_* settings as `serve`, so it speaks TLS (and mutual TLS) when the server does.
# Loading a large checkpoint takes minutes; failures during the start period do not count.
HEALTHCHECK --interval=15s --timeout=10s --start-period=600s --retries=3 CMD ["logprob-service", "probe"]
# SIGTERM drains (--grace-period-s, 30 s by default): give `docker stop` more time than that (-t 45).
STOPSIGNAL SIGTERM
ENTRYPOINT ["logprob-service", "serve"]
