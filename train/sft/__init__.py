"""Supervised fine-tuning: the examples (`data`, `embedded`), which of them form each minibatch (`sampler`), how a
plan becomes device arrays (`batching`), and the loop (`loop.run_sft`).

Importing the package does not import JAX (the CLI sets XLA flags first); `run_sft` is loaded on first use.
"""

__all__ = ["run_sft"]


def __getattr__(name):
    if name == "run_sft":
        from .loop import run_sft

        return run_sft
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
