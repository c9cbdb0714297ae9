"""Default prompt templates for the verbalizer (AV) and reconstructor (AR).

The AV template puts the marker between ``<<`` and ``>>`` so that, once the marker is a
single added token, its left and right neighbours are fixed tokens the injection code can
check (docs/design.md §3.4). The AR template ends in a constant tail after ``{explanation}``; the
reconstructor reads its prediction at the last token of that tail, so the tail must
tokenise identically whatever the explanation is (the leading newline keeps it from
merging with the explanation's last word).
"""

from __future__ import annotations

DEFAULT_AV_TEMPLATE = "Explain the hidden state <<{injection_char}>> in a few short sentences."
DEFAULT_AR_TEMPLATE = "Explanation: {explanation}\nSummary vector:"

# The literal placeholder stored in parquet AV prompts; swapped for the real marker at load time.
AV_PLACEHOLDER = "<INJECT>"

# Default single-token injection marker (a rare CJK character, as in the published checkpoints).
DEFAULT_INJECTION_CHAR = "㈎"

# A pair for several blocks (datagen ``layers``) names the block in both prompts, so one AV and one AR
# read every block: the AV is told where the vector comes from, the AR which block to rebuild. The
# block sits away from the marker (whose neighbours stay ``<<`` and ``>>``) and before the explanation
# (the AR's tail stays constant).
LAYERED_AV_TEMPLATE = "Explain the hidden state <<{injection_char}>> of block {layer} in a few short sentences."
LAYERED_AR_TEMPLATE = "Block {layer}. Explanation: {explanation}\nSummary vector:"
