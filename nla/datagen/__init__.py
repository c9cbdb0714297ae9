"""Data generation: activations -> split by document -> explanations -> training parquets.

Stages (docs/design.md §2), each a module and a `nla datagen <stage>` step:
`extract` (nla.datagen.extract), `split`, `explain` (+ `providers` for HTTP
explainers), `build`; `pipeline.run` runs them all, resumably.
"""

from nla.datagen.build import build_datasets, load_dataset
from nla.datagen.config import DatagenConfig, ProviderConfig, WorldExplainerConfig
from nla.datagen.corpus import CorpusDoc, read_text_corpus, world_corpus
from nla.datagen.explain import (
    EXPLAINERS,
    Explainer,
    explain_table,
    extract_tagged,
    make_explainer,
    register_explainer,
)
from nla.datagen.extract import consolidate_shards, extract_activations
from nla.datagen.io import DatagenError, read_parquet, read_vectors, write_parquet_atomic
from nla.datagen.pipeline import STAGES, run
from nla.datagen.split import split_doc_ids, split_table

__all__ = [
    "EXPLAINERS",
    "STAGES",
    "CorpusDoc",
    "DatagenConfig",
    "DatagenError",
    "Explainer",
    "ProviderConfig",
    "WorldExplainerConfig",
    "build_datasets",
    "consolidate_shards",
    "explain_table",
    "extract_activations",
    "extract_tagged",
    "load_dataset",
    "make_explainer",
    "read_parquet",
    "read_text_corpus",
    "read_vectors",
    "register_explainer",
    "run",
    "split_doc_ids",
    "split_table",
    "world_corpus",
    "write_parquet_atomic",
]
