"""The fast paths: decoding without `generate` (decoding) and the log-probabilities of packed completions
(packing), each checked token for token against the plain definitions in model.py.

Imports only the plain layer (the root's model.py, infra/) and itself.
"""
