"""nla: Natural Language Autoencoders.

A verbalizer (AV) turns an activation vector of a subject model into text; a
reconstructor (AR) maps the text back to a vector. See DESIGN.md for the map.
"""

from nla.numerics import pin_cpu_kernels as _pin_cpu_kernels

# Before anything loads torch: the same CPU kernels on every x86 machine (nla.numerics).
_pin_cpu_kernels()

__version__ = "0.1.0"
