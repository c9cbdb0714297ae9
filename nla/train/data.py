"""The deterministic data cursor: which training rows each step reads, resumable."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


# ---------------------------------------------------------------- data cursor
@dataclass
class DataCursor:
    """Deterministic pass over ``n`` rows: a fresh permutation per epoch keyed on ``(seed, epoch)``.

    The state is just ``(epoch, position)``, so a resumed run continues at the exact sample.
    """

    n: int
    seed: int
    epoch: int = 0
    position: int = 0
    shuffle: bool = True

    def __post_init__(self) -> None:
        if self.n <= 0:
            raise ValueError(f"DataCursor: n must be positive, found {self.n}")

    def order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.n)
        return np.random.default_rng([self.seed, epoch]).permutation(self.n)

    def next_indices(self, k: int) -> np.ndarray:
        """The next ``k`` row indices, continuing into the next epoch when this one runs out."""
        out: list[np.ndarray] = []
        need = k
        while need > 0:
            order = self.order(self.epoch)
            take = order[self.position : self.position + need]
            out.append(take)
            need -= len(take)
            self.position += len(take)
            if self.position >= self.n:
                self.epoch += 1
                self.position = 0
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n, "seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if int(state["n"]) != self.n or int(state["seed"]) != self.seed:
            raise ValueError(
                f"data cursor mismatch: checkpoint was saved for n={state['n']}, seed={state['seed']}, "
                f"this run has n={self.n}, seed={self.seed}; resume with the same dataset and seed"
            )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
