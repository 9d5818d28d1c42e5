# megatron-agent on GPU: an NGC PyTorch image (torch, CUDA, NCCL, Transformer Engine, NVIDIA apex)
# plus megatron-core, vLLM, Ray and the HF libraries.
#
#   docker build -t megatron-agent --build-arg NGC_TAG=25.11-py3 .
#
# The container's torch, Transformer Engine and triton are frozen with a constraints file before
# anything else is installed, so `pip install vllm` cannot silently replace the container's torch
# (a common failure of RL stacks): if the vLLM release asks for another torch, the build fails and
# says so. Pick VLLM_SPEC (e.g. "vllm==0.33.0") to match the image's torch.
ARG NGC_TAG=25.11-py3
FROM nvcr.io/nvidia/pytorch:${NGC_TAG}

ARG VLLM_SPEC=vllm
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    NCCL_DEBUG=WARN

WORKDIR /opt/megatron-agent
RUN python -m pip freeze | grep -iE '^(torch|transformer[-_]engine|triton|apex)==' > /opt/container-constraints.txt \
    && cat /opt/container-constraints.txt
COPY requirements/gpu.txt requirements/test.txt requirements/
RUN grep -v '^vllm$' requirements/gpu.txt > /tmp/gpu-no-vllm.txt \
    && python -m pip install -c /opt/container-constraints.txt -r /tmp/gpu-no-vllm.txt -r requirements/test.txt \
    && python -m pip install -c /opt/container-constraints.txt "${VLLM_SPEC}"
COPY . .
RUN python -m pip install --no-deps --no-build-isolation -e . \
    && python -c "import megatron.core, transformer_engine, vllm, ray; print('stack ok')"
