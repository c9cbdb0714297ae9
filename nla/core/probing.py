"""Linear probes on activation vectors: the world's probe and the explanation suite's fact directions.

Vectors are read as an NLA reads them, by direction: each row is normalised to unit length, then
standardised with the training rows' mean and spread; a multi-label logistic regression over
those features is fitted by full-batch L-BFGS (torch's; no solver of our own).
"""

from __future__ import annotations

import torch

__all__ = ["fit_logistic", "standardise"]


def standardise(x_train: torch.Tensor, x_test: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x_train = torch.nn.functional.normalize(x_train, dim=-1)
    x_test = torch.nn.functional.normalize(x_test, dim=-1)
    mu, sd = x_train.mean(0), x_train.std(0).clamp_min(1e-6)
    return (x_train - mu) / sd, (x_test - mu) / sd


def fit_logistic(x: torch.Tensor, y: torch.Tensor, l2: float, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-label logistic regression ``sigmoid(x @ w + b)`` by full-batch L-BFGS.  x [N, d], y [N, F]."""
    w = torch.zeros(x.shape[1], y.shape[1], requires_grad=True)
    b = torch.zeros(y.shape[1], requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=1.0, max_iter=steps, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(x @ w + b, y) + l2 * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach(), b.detach()
