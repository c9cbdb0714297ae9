"""Leaf utilities: input validation, config checks, threads, CPU code paths, files, metrics logs.

Nothing here imports from nla outside ``nla.util`` (tests/test_layering.py holds it).
"""
