"""The model contract: sidecars, templates, architectures, injection, the reconstructor, LoRA,
vectors and their metrics, provenance, graders and the reward's definition.

Imports only ``nla.util`` and ``nla.core`` (tests/test_layering.py holds it): what every stage,
the client and the evaluation share.
"""
