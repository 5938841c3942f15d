"""CPU twin of kernels/cuda/sampler.py: one token from a logits row of this backend (the reference
sampler, pykv.decoder.sampler.Sampler, on host logits)."""
import numpy as np


def pick(logits, sampler, history, u: float) -> int:
    """The token sampler.pick chooses from logits (V,) for the uniform draw u."""
    return sampler.pick(np.asarray(logits).reshape(-1), history, u)
