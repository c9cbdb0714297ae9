"""Reinforcement learning for the verbalizer (docs/design.md §4).

``nla.rl.algorithms`` holds the pure tensor math (advantages, losses, KL,
DAPO helpers). Nothing is imported here, so importing one submodule never
pulls in the heavier ones (roles, Ray backend).
"""
