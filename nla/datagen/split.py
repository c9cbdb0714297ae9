"""Stage 2, split: document-level partition into av_sft / ar_sft / rl.

All rows of a document land in one split, so no split sees a document another
split trained on. The partition depends only on the set of doc ids and the seed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from nla.datagen.config import SPLITS
from nla.datagen.io import DatagenError

log = logging.getLogger(__name__)

# Salt so the split permutation is not the same stream as anything else keyed on `seed`.
_SPLIT_SALT = 0x5B117


def split_doc_ids(
    doc_ids: Sequence[int] | np.ndarray, fractions: Sequence[float], seed: int
) -> dict[str, np.ndarray]:
    """Map split name -> sorted doc ids. Counts are round(f * n) for the first two splits, the rest to rl."""
    if len(fractions) != len(SPLITS):
        raise DatagenError(
            f"split fractions: expected {len(SPLITS)} values for {SPLITS}, found {list(fractions)}"
        )
    unique = np.unique(np.asarray(doc_ids, dtype=np.int64))
    if len(unique) == 0:
        raise DatagenError("split: no documents to split; the extract stage produced no rows")
    perm = np.random.default_rng([seed, _SPLIT_SALT]).permutation(unique)
    n = len(unique)
    n_av = int(round(fractions[0] * n))
    n_ar = min(int(round(fractions[1] * n)), n - n_av)
    cuts = {"av_sft": perm[:n_av], "ar_sft": perm[n_av : n_av + n_ar], "rl": perm[n_av + n_ar :]}
    for name, frac in zip(SPLITS, fractions, strict=True):
        if frac > 0 and len(cuts[name]) == 0:
            log.warning("split %s gets 0 of %d documents (fraction %.3g); use more documents", name, n, frac)
    return {k: np.sort(v) for k, v in cuts.items()}


def split_table(table: pa.Table, fractions: Sequence[float], seed: int) -> dict[str, pa.Table]:
    """Partition rows by their `doc_id` (see `split_doc_ids`); row order within a split is kept."""
    if "doc_id" not in table.column_names:
        raise DatagenError(f"split: column 'doc_id' missing; found {table.column_names}")
    ids = split_doc_ids(table.column("doc_id").to_numpy(), fractions, seed)
    return {name: table.filter(pc.is_in(table.column("doc_id"), pa.array(v))) for name, v in ids.items()}
