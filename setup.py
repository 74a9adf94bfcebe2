"""megatron-npu: Megatron-style GPT pretraining on Ascend NPUs with megatron-core."""

import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
VERSION_PY = (HERE / "megatron_npu" / "version.py").read_text()
VERSION = re.search(r'__version__ = "([^"]+)"', VERSION_PY).group(1)
# The tested megatron-core range is stated once, in megatron_npu/version.py.
MEGATRON_CORE_RANGE = re.search(r'TESTED_MEGATRON_CORE_RANGE = "([^"]+)"', VERSION_PY).group(1)

setup(
    name="megatron-npu",
    version=VERSION,
    description="Run Megatron-LM style GPT pretraining on Ascend NPUs with torch_npu and megatron-core",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_npu", "megatron_npu.*"]),
    install_requires=[
        "torch>=2.4",
        f"megatron-core{MEGATRON_CORE_RANGE}",
        "einops",  # megatron-core's Megatron-FSDP builds its device mesh with it (--use-megatron-fsdp)
        "numpy",
        "packaging",
        "psutil",
        "pyyaml",
        "sentencepiece",
        "transformers",
    ],
    extras_require={
        "npu": ["torch_npu"],
        "wandb": ["wandb"],
        "convert": ["safetensors", "transformers"],  # megatron-npu convert (Hugging Face checkpoints)
        # megatron-core's own unit tests (tests/conformance): the packages its suite imports that this project does
        # not need (tests/conformance/environment.py says which test needs each; the git-only emerging_optimizers
        # is named there). pytest-asyncio is a pytest plugin: install this extra in a venv of its own.
        "conformance": ["fastapi", "uvicorn", "mock", "msgpack", "pytest-asyncio", "pyzmq", "flask-restful", "nvtx"],
        "test": [
            "pytest>=7",
            "pytest-mock",
            "ruff",
            "matplotlib",
            "tensorboard",
            "wandb",
            "safetensors",
            "transformers",
            "nltk>=3.9",
        ],
    },
    entry_points={"console_scripts": ["megatron-npu=megatron_npu.cli:main"]},
)
