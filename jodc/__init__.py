"""jodc: JAX post-training (SFT and RL) with On-Demand Communication for wildly varying sequence lengths.

The distribution has three package roots from three folders of the checkout: ``jodc`` (this folder: the library),
``jodc.models`` (``models/``: the Flax decoders) and ``jodc.train`` (``train/``: the SFT and RL trainers), declared
once in pyproject.toml's ``[tool.setuptools.package-dir]``.
"""

__version__ = "0.1.0"
