"""jodc: JAX post-training (SFT and RL) with On-Demand Communication for wildly varying sequence lengths."""

__version__ = "0.1.0"
