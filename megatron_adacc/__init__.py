"""megatron-adacc: adaptive activation-memory optimisation for Megatron-core GPT training.

    from megatron_adacc import Adacc, AdaccConfig      # the one entry point (adacc.py)
"""

__version__ = "0.1.0"
__all__ = ["Adacc", "AdaccConfig"]


def __getattr__(name: str):
    # Imported on first use: `import megatron_adacc.codecs` stays free of megatron-core.
    if name in __all__:
        from megatron_adacc import adacc

        return getattr(adacc, name)
    raise AttributeError(f"module 'megatron_adacc' has no attribute {name!r}")
