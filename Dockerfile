# syntax=docker/dockerfile:1
# Strata: one image for every service; the command picks which (`strata engine|gateway|cachemgr`).
#
#   CPU image (default):
#     docker build -t strata:0.1.0 .
#   CUDA engine image (CUDA VARIANT: same Dockerfile, the torch wheel comes from a CUDA index):
#     docker build -t strata:0.1.0-cuda --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#
# Why the CUDA variant keeps the slim Debian base instead of nvidia/cuda:*-runtime: torch's CUDA
# wheels carry the CUDA user-space libraries (cudart, cuBLAS, cuDNN, NCCL) as pip packages, and the
# host's driver (libcuda) is mounted in at run time by the NVIDIA Container Toolkit. An nvidia/cuda
# base would add a second CUDA copy, and its Python is not the 3.11 the builder's venv links to.
# Pick a cuXXX index that publishes the torch version pyproject.toml allows and that the host
# driver supports (`nvidia-smi` shows the highest CUDA version the driver runs).

# Pinned to Python 3.11 on Debian 12. For bit-for-bit rebuilds pass a digest:
#   --build-arg PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:<digest>
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src

# torch on its own layer, from the chosen PyTorch index, with the version range read from
# pyproject.toml (one place states it); `pip install .` below then finds torch satisfied and
# source edits do not re-download it.
COPY pyproject.toml ./
RUN python -c "import re, tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; print(next(d for d in deps if re.match(r'torch\b', d)))" > /tmp/torch.txt \
 && pip install --index-url "${TORCH_INDEX_URL}" -r /tmp/torch.txt

COPY README.md ./
COPY services ./services
RUN pip install . && pip check


FROM ${PYTHON_IMAGE} AS runtime
ARG STRATA_UID=10001
# gcc: the engine builds its CPU decode kernels (services/engine/kernels/cpu_kernels.c) at first
# start for the CPU it runs on (-march=native) and caches them under $HOME/.cache (/data);
# without a compiler it serves on torch ops, slower. On CUDA, Triton (which the CUDA torch wheel
# brings) compiles its kernels' launcher stubs with it too. Unpinned: Debian's security updates replace
# these versions, and a pin would break rebuilds.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
# /data is STRATA_HOME. Its subdirectories exist (owned by strata) in the image so that a fresh
# named volume mounted on them starts with that ownership and the non-root services can write.
RUN groupadd --system --gid "${STRATA_UID}" strata \
 && useradd --system --uid "${STRATA_UID}" --gid strata --home-dir /data --no-create-home \
      --shell /usr/sbin/nologin strata \
 && mkdir -p /data/models /data/cachemgr \
 && chown -R strata:strata /data
COPY --from=builder /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    STRATA_HOME=/data
# Numeric, so the runtime (and Kubernetes' runAsNonRoot) can tell it is not root without
# reading /etc/passwd.
USER ${STRATA_UID}:${STRATA_UID}
WORKDIR /data

# gateway HTTP, engine gRPC, cachemgr gRPC; Prometheus /metrics of cachemgr, gateway, engine
EXPOSE 8000 50051 50061 9464 9465 9466

# Fits the default command (the gateway): 200 from /readyz once an engine is reachable (cheap;
# /health would run a generation every check). Containers that run the engine or the cachemgr
# override it with a gRPC health check (deploy/compose.yaml does).
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/readyz' % os.environ.get('STRATA_GATEWAY_PORT', '8000'), timeout=4)"]

ENTRYPOINT ["strata"]
CMD ["gateway"]
