"""nla: Natural Language Autoencoders.

A verbalizer (AV) turns an activation vector of a subject model into text; a
reconstructor (AR) maps the text back to a vector. See DESIGN.md for the map.
"""

__version__ = "0.1.0"
