"""The deterministic data cursor: which training rows each step reads, resumable."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


# ---------------------------------------------------------------- data cursor
@dataclass
class DataCursor:
    """Deterministic pass over ``n`` rows: a fresh permutation per epoch keyed on ``(seed, epoch)``.

    The state is just ``(epoch, position)``, so a resumed run continues at the exact sample.

    ``groups`` (one label per row, e.g. each row's layer) with ``batch``: every ``batch`` consecutive
    indices come from one group, the epoch's batches in a random order (a pair for several layers then
    pads a batch to one layer's lengths, as a one-layer pair does). Each group's rows are permuted, cut
    into whole batches, and the rows left over (fewer than ``batch`` in a group) sit the epoch out; the
    next epoch's permutation leaves out others. Read it ``batch`` indices at a time.
    """

    n: int
    seed: int
    epoch: int = 0
    position: int = 0
    shuffle: bool = True
    groups: np.ndarray | None = field(default=None, compare=False, repr=False)
    batch: int = 0

    def __post_init__(self) -> None:
        if self.n <= 0:
            raise ValueError(f"DataCursor: n must be positive, found {self.n}")
        self._cached: tuple[int, np.ndarray] | None = None
        if self.groups is not None:
            self.groups = np.asarray(self.groups)
            if len(self.groups) != self.n:
                raise ValueError(f"DataCursor: {len(self.groups)} group labels for {self.n} rows; give one a row")
            if self.batch < 1:
                raise ValueError(f"DataCursor: batch must be >= 1 with groups, found {self.batch}")
            labels, counts = np.unique(self.groups, return_counts=True)
            if not (counts >= self.batch).any():
                raise ValueError(f"DataCursor: no group has a whole batch of {self.batch} rows (groups "
                                 f"{dict(zip(labels.tolist(), counts.tolist(), strict=True))}); lower the batch size "
                                 "or batch the groups together")

    def order(self, epoch: int) -> np.ndarray:
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1]
        if not self.shuffle:
            out = np.arange(self.n)
        elif self.groups is None:
            out = np.random.default_rng([self.seed, epoch]).permutation(self.n)
        else:
            rng = np.random.default_rng([self.seed, epoch])
            chunks = []
            for g in np.unique(self.groups):
                rows = rng.permutation(np.flatnonzero(self.groups == g))
                whole = len(rows) // self.batch * self.batch
                chunks.extend(rows[:whole].reshape(-1, self.batch))
            out = np.concatenate([chunks[i] for i in rng.permutation(len(chunks))])
        self._cached = (epoch, out)
        return out

    def next_indices(self, k: int) -> np.ndarray:
        """The next ``k`` row indices, continuing into the next epoch when this one runs out."""
        if self.groups is not None and k != self.batch:
            raise ValueError(f"DataCursor: a cursor of one-group batches of {self.batch} rows was asked for {k}")
        out: list[np.ndarray] = []
        need = k
        while need > 0:
            order = self.order(self.epoch)
            take = order[self.position : self.position + need]
            out.append(take)
            need -= len(take)
            self.position += len(take)
            if self.position >= len(order):
                self.epoch += 1
                self.position = 0
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def state_dict(self) -> dict[str, int]:
        state = {"n": self.n, "seed": self.seed, "epoch": self.epoch, "position": self.position}
        if self.groups is not None:  # absent for a plain cursor: states saved before groups stay the same
            state["group_batch"] = self.batch
        return state

    def load_state_dict(self, state: dict[str, int]) -> None:
        if int(state["n"]) != self.n or int(state["seed"]) != self.seed:
            raise ValueError(
                f"data cursor mismatch: checkpoint was saved for n={state['n']}, seed={state['seed']}, "
                f"this run has n={self.n}, seed={self.seed}; resume with the same dataset and seed"
            )
        saved = int(state.get("group_batch", 0))
        mine = self.batch if self.groups is not None else 0
        if saved != mine:
            def says(b: int) -> str:
                return f"batches of one layer ({b} rows)" if b else "batches mixing the layers"

            raise ValueError(f"data cursor mismatch: checkpoint was saved reading {says(saved)}, this run reads "
                             f"{says(mine)}; resume with the same batches_by_layer and batch_size")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])


def layer_column(table: Any, dataset: str, setting: str) -> np.ndarray:
    """Each row's layer (the ``activation_layer`` column datagen writes for a run over several layers),
    for a ``setting`` that needs it; a clear ValueError naming the dataset and the fix without it."""
    if "activation_layer" not in table.column_names:
        raise ValueError(f"{setting}: dataset {dataset} has no activation_layer column (each row's layer, which "
                         f"{setting} needs); rebuild it with nla datagen for several layers, or set {setting}: false")
    return np.asarray(table.column("activation_layer").to_pylist(), dtype=np.int64)
