"""The smoke's reward (benchmarks/gpu_bench.py --smoke, and the tests that need groups to split), in a module
that imports nothing: a reward runs in a process of its own, which imports the module named, and gpu_bench.py
imports torch and transformers first, seconds at every start."""


def parity_reward(completion: str, gold: str) -> float:
    """The parity of the sum of the completion's character codes, a coin flip per completion on random
    weights: a group of G is split but with probability 2^(1 - G), so the methods' updates have rows to
    train (the verifier's rewards on random weights are all 0: every group collapses, no backward runs)."""
    return float(sum(map(ord, completion)) % 2)
