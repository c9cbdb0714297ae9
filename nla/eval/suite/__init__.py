"""Does it explain? The explanation suite: tests that an NLA's text is a true, causal account.

A round-trip score says the AR can rebuild the vector from the text, not that the text is true
or that the vector does what the text says. The suite measures that, where the dataset's grader
(``nla.core.graders``) knows the truth, and runs its truth-free parts on any pair:

1. **claim attribution** (``attribute_claims``): delete each claim of an explanation and
   re-score with the AR; ``delta_mse`` = mse without the claim - mse with it (> 0: the AR used
   it). With truth: the mean cost of deleting a true vs a false claim.
2. **hidden-code tests** (``hidden_code_variants``): FVE after re-phrasing every claim (the
   grader's phrasings, or a provider's for a real model), after shuffling the order of the
   claims, and after dropping the quotation (the world's: of the text's end). An honest explanation loses
   little; a private code (meaning carried by phrasing or order) loses much.
3. **causal edits** (``causal_edits``): rows where the subject predicts a true fact as its next
   token (a recall slot); the explanation's claim of that fact is edited to another value of its
   kind, the AR reconstructs the edited text, the result (at the original vector's norm) replaces
   the subject's residual at the extraction layer and position (``patch_residual``), and the
   subject's top prediction is read. Baselines: the unedited explanation's reconstruction, a
   random vector of the same norm, and (no text) the same edit as a difference of class means,
   which says whether that residual drives the prediction at all. ``steering_vector`` is the generic tool: words -> a vector.
4. **directions** (``fact_directions``, ``direction_inputs``, ``norm_warnings``): verbalize a
   direction that is no activation (a linear probe's weight for one fact, added to the data's
   mean, at the data's norm), with a warning when an input's norm is far outside the data's.
5. **confabulation** (``confabulation``): the false-claim rate per fact kind for each AV
   (warm-start vs RL), and whether claims that recur at neighbouring positions of one document
   are more often true.
6. **best-of-N** (``best_of_n``): ``NLAClient.verbalize(best_of=N)`` keeps the sample the AR
   reconstructs best; FVE, recall and precision at N = 1, 4, 8 against greedy decoding.

``run_suite`` runs them on a held-out dataset and returns a ``SuiteReport`` (JSON, markdown with
each target met or missed); ``nla eval --suite`` is its command. A pair for several blocks is tested a
block at a time (``run_suite(layer=K)`` on that block's rows; ``run_suite_by_block`` every block, a
``SuiteByBlock``). Ground truth only grades here.

Conventions: a claim is one sentence of the grader's ``claims``; facts are ``"kind=value"``
strings (the kind is the part before ``=``); an explanation left without any claim is read by the
AR as the empty explanation (not a failed sample: the AR reads what is left); failed samples of
the AV (no explanation) have no claims and are charged the failure cost wherever FVE is taken.
"""

from nla.eval.suite.best_of import best_of_n
from nla.eval.suite.causal import causal_edits, patch_residual, patched_next_token_logits, steering_vector
from nla.eval.suite.claims import Claim, attribute_claims, claims_summary
from nla.eval.suite.common import PARTS, TARGETS, fact_kind
from nla.eval.suite.confabulation import confabulation
from nla.eval.suite.directions import direction_inputs, fact_directions, norm_warnings, verbalize_directions
from nla.eval.suite.hidden_code import hidden_code_variants
from nla.eval.suite.report import SuiteByBlock, SuiteReport, block_targets_table, targets_table
from nla.eval.suite.run import run_suite, run_suite_by_block

__all__ = [
    "PARTS", "TARGETS", "Claim", "SuiteByBlock", "SuiteReport", "attribute_claims", "best_of_n", "causal_edits", "claims_summary",
    "confabulation", "direction_inputs", "fact_directions", "fact_kind", "hidden_code_variants", "norm_warnings",
    "block_targets_table", "patch_residual", "patched_next_token_logits", "run_suite", "run_suite_by_block",
    "steering_vector", "targets_table",
    "verbalize_directions",
]
