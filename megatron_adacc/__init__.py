"""megatron-adacc: adaptive activation-memory optimisation for Megatron-core GPT training."""

__version__ = "0.1.0"
