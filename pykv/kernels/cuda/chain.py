"""GPU twin of kernels/chain.py: the decode step's tail-and-head chain.

On the GPU each product and row op is its own kernel launch, queued asynchronously behind the one
before it, so there is no thread start or idle thread to save: bind returns None and the model runs
the layer's calls one by one (the same math: the CPU chain equals its separate calls bit for bit)."""


def enabled() -> bool:
    return False


def bind(tail, head, views, act_d, act_ff, sign, rotate: bool, eps: float, kv):
    return None
