# megatron-agent on GPU: a pinned NGC PyTorch image (torch, CUDA, NCCL, Transformer Engine, NVIDIA
# apex) plus megatron-core, vLLM, Ray, nvidia-modelopt and this package.
#
#   docker build -t megatron-agent .
#   docker build -t megatron-agent --build-arg NGC_TAG=<tag> --build-arg VLLM_VERSION=<version> .
#
# The image's torch, Transformer Engine, apex and triton are frozen in a constraints file before
# anything is installed, so nothing can replace them. vLLM wheels pin one torch release exactly
# (vllm 0.33.0: torch==2.14.0), which pip would "fix" by installing a PyPI torch over the image's
# (the known trap). So vLLM goes in with --no-deps, its other requirements with the constraints,
# and the build ends by checking that torch, transformer_engine, apex, megatron.core, vllm, ray
# and modelopt import with the pinned versions and that vLLM's torch release is the image's: a
# VLLM_VERSION that does not fit NGC_TAG fails the build and says which to change.
ARG NGC_TAG=25.11-py3
FROM nvcr.io/nvidia/pytorch:${NGC_TAG}

ARG MEGATRON_CORE_VERSION=0.19.2
ARG VLLM_VERSION=0.33.0
ARG RAY_VERSION=2.60.0
ARG MODELOPT_VERSION=0.47.0

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    NCCL_DEBUG=WARN \
    RAY_USAGE_STATS_ENABLED=0

WORKDIR /opt/megatron-agent

# 0. bubblewrap, the python tool's sandbox (docs/sandbox.md): without it, a run that enables the
#    python tool refuses to start. Whether it can create its namespaces depends on the container
#    runtime, so each node checks at launch (examples/slurm/ray_launch.sh, SANDBOX_CHECK).
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends bubblewrap \
    && rm -rf /var/lib/apt/lists/* \
    && bwrap --version

# 1. What the image brings stays as it is.
RUN python -m pip list --format=freeze \
      | grep -iE '^(torch|transformer[-_]engine[-_a-z0-9]*|apex|triton|flash[-_]attn)==' \
      > /opt/container-constraints.txt \
    && grep -iq '^torch==' /opt/container-constraints.txt \
    && printf '%s\n' "megatron-core==${MEGATRON_CORE_VERSION}" "vllm==${VLLM_VERSION}" \
         "ray==${RAY_VERSION}" "nvidia-modelopt==${MODELOPT_VERSION}" > /opt/megatron-agent-pins.txt \
    && cat /opt/container-constraints.txt /opt/megatron-agent-pins.txt

# 2. megatron-core, Ray, modelopt and the HF libraries, with the image's packages frozen.
COPY requirements/gpu.txt requirements/test.txt requirements/
RUN grep -vE '^(vllm|megatron-core|ray)' requirements/gpu.txt > /tmp/gpu-rest.txt \
    && python -m pip install -c /opt/container-constraints.txt \
         "megatron-core==${MEGATRON_CORE_VERSION}" "ray[default]==${RAY_VERSION}" \
         "nvidia-modelopt==${MODELOPT_VERSION}" -r /tmp/gpu-rest.txt -r requirements/test.txt

# 3. vLLM without its torch pin: the wheel itself, then its other requirements (not torch,
#    torchvision, torchaudio, torchcodec) with the image's packages frozen.
RUN python -m pip install --no-deps "vllm==${VLLM_VERSION}" \
    && python -c "import importlib.metadata as m; from packaging.requirements import Requirement as R; \
skip = {'torch', 'torchvision', 'torchaudio', 'torchcodec'}; \
reqs = [R(r) for r in m.requires('vllm') or []]; \
print('\n'.join(str(r) for r in reqs if r.name not in skip and (r.marker is None or r.marker.evaluate({'extra': ''}))))" \
      > /tmp/vllm-deps.txt \
    && python -m pip install -c /opt/container-constraints.txt -r /tmp/vllm-deps.txt

# 4. This package, then the build-time check of the whole stack.
COPY . .
RUN python -m pip install --no-deps --no-build-isolation -e . \
    && python -m megatron_agent.platform.versions --platform gpu \
         --imports torch transformer_engine apex megatron.core vllm ray modelopt \
         --pins /opt/container-constraints.txt --pins /opt/megatron-agent-pins.txt
