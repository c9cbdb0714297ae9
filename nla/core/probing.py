"""Linear probes on activation vectors: the world's probe and the explanation suite's fact directions.

Vectors are read as an NLA reads them, by direction: each row is normalised to unit length, then
standardised with the training rows' mean and spread; a multi-label logistic regression over
those features is fitted by full-batch L-BFGS (torch's; no solver of our own). The unit probe
(``read_units``, ``held_units``) reads which word or mark a vector's token is, by multinomial logistic
regression, for the data explainer's rule of quoting only what the vector holds (issue 57).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["fit_logistic", "fit_softmax", "held_units", "read_units", "standardise"]


def standardise(x_train: torch.Tensor, x_test: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x_train = torch.nn.functional.normalize(x_train, dim=-1)
    x_test = torch.nn.functional.normalize(x_test, dim=-1)
    mu, sd = x_train.mean(0), x_train.std(0).clamp_min(1e-6)
    return (x_train - mu) / sd, (x_test - mu) / sd


def _fit_linear(x: torch.Tensor, n_out: int, loss_of, l2: float, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [d, n_out], ``b`` [n_out] minimising ``loss_of(x @ w + b) + l2 * |w|^2`` by full-batch L-BFGS
    from zeros (deterministic: no random start)."""
    w = torch.zeros(x.shape[1], n_out, requires_grad=True)
    b = torch.zeros(n_out, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=1.0, max_iter=steps, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = loss_of(x @ w + b) + l2 * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach(), b.detach()


def fit_logistic(x: torch.Tensor, y: torch.Tensor, l2: float, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-label logistic regression ``sigmoid(x @ w + b)`` by full-batch L-BFGS.  x [N, d], y [N, F]."""
    return _fit_linear(x, y.shape[1], lambda z: torch.nn.functional.binary_cross_entropy_with_logits(z, y), l2, steps)


def fit_softmax(x: torch.Tensor, y: torch.Tensor, n_classes: int, l2: float = 1e-3,
                steps: int = 300) -> tuple[torch.Tensor, torch.Tensor]:
    """Multinomial logistic regression ``softmax(x @ w + b)`` by full-batch L-BFGS.  x [N, d], y [N] class ids."""
    return _fit_linear(x, n_classes, lambda z: torch.nn.functional.cross_entropy(z, y), l2, steps)


def read_units(x_fit: np.ndarray, units_fit: Sequence[str], x_read: np.ndarray, min_count: int = 2,
               l2: float = 1e-3, steps: int = 300) -> tuple[list[str | None], np.ndarray]:
    """What a linear probe fitted on ``(x_fit, units_fit)`` reads from each row of ``x_read``: the unit
    it ranks first and that unit's probability. The classes are the units seen at least ``min_count``
    times in the fit rows; vectors are read by direction (``standardise`` on the fit rows). With one
    class every row reads it (probability 1); with none the probe reads nothing: (None, 0.0)."""
    if len(units_fit) != len(x_fit):
        raise ValueError(f"read_units: {len(x_fit)} fit vectors for {len(units_fit)} units; they must match one to one")
    counts = Counter(units_fit)
    classes = sorted(u for u, c in counts.items() if c >= min_count)
    if not classes or len(x_read) == 0:
        return [None] * len(x_read), np.zeros(len(x_read))
    if len(classes) == 1:
        return [classes[0]] * len(x_read), np.ones(len(x_read))
    index = {u: i for i, u in enumerate(classes)}
    keep = [i for i, u in enumerate(units_fit) if u in index]
    x_tr, x_te = standardise(torch.as_tensor(np.asarray(x_fit)[keep], dtype=torch.float32),
                             torch.as_tensor(np.asarray(x_read), dtype=torch.float32))
    w, b = fit_softmax(x_tr, torch.tensor([index[units_fit[i]] for i in keep]), len(classes), l2, steps)
    prob = torch.softmax(x_te @ w + b, dim=-1)
    top_p, top = prob.max(-1)
    return [classes[int(k)] for k in top], top_p.double().numpy()


def _folds(name: str, groups: Sequence[int], folds: int, min_prob: float) -> np.ndarray:
    """Each row's fold (its group modulo ``folds``: a document stays in one), the settings checked."""
    if not 0.0 <= min_prob <= 1.0:
        raise ValueError(f"{name}: min_prob must be in [0, 1], found {min_prob!r}")
    if folds < 2:
        raise ValueError(f"{name}: folds must be >= 2, found {folds!r}")
    return np.asarray(groups, dtype=np.int64) % folds


def held_units(x: np.ndarray, units: Sequence[str], groups: Sequence[int], min_prob: float,
               x_other: np.ndarray | None = None, units_other: Sequence[str] | None = None,
               folds: int = 2, **kw) -> tuple[np.ndarray, np.ndarray | None]:
    """Whether each row's vector holds its unit, as a linear probe that never saw the row's group says:
    the probe ranks the row's own unit first with probability >= ``min_prob``.

    ``x``/``units``/``groups``: the rows the probe learns from, cross-fitted (each row is read by the
    probe fitted on the other ``folds - 1`` folds; a group, e.g. a document, stays in one fold, by
    ``group % folds``); ``x_other``/``units_other``: rows read by the probe fitted on all of ``x``
    (held-out documents). Returns (held for ``x``, held for ``x_other`` or None)."""
    x, fold = np.asarray(x), _folds("held_units", groups, folds, min_prob)
    held = np.zeros(len(units), dtype=bool)
    for k in range(folds):
        fit, read = np.flatnonzero(fold != k), np.flatnonzero(fold == k)
        top, p = read_units(x[fit], [units[i] for i in fit], x[read], **kw)
        held[read] = [t is not None and t == units[i] and q >= min_prob for t, q, i in zip(top, p, read, strict=True)]
    other = None
    if x_other is not None:
        if units_other is None or len(units_other) != len(x_other):
            raise ValueError("held_units: units_other must give one unit per row of x_other")
        top, p = read_units(x, list(units), np.asarray(x_other), **kw)
        other = np.array([t is not None and t == u and q >= min_prob for t, q, u in zip(top, p, units_other, strict=True)],
                         dtype=bool)
    return held, other


def _label_probs(x_fit: np.ndarray, labels_fit: Sequence[Sequence[str]], x_read: np.ndarray, min_count: int = 2,
                 l2: float = 1e-3, steps: int = 300) -> tuple[list[str | None], np.ndarray]:
    """(classes, probabilities [n_read, len(classes)]) of a softmax probe over a kind's labels and "none"
    (``classes[0]`` is None: a row without a label of the kind). A row with several labels (two persons)
    is fitted to share its mass equally among them. The labels are those seen at least ``min_count`` times;
    vectors are read by direction (``standardise``)."""
    if len(labels_fit) != len(x_fit):
        raise ValueError(f"read_labels: {len(x_fit)} fit vectors for {len(labels_fit)} label sets; they must match")
    counts = Counter(lab for labs in labels_fit for lab in set(labs))
    classes: list[str | None] = [None, *sorted(u for u, c in counts.items() if c >= min_count)]
    if len(classes) == 1 or len(x_read) == 0:
        return classes, np.ones((len(x_read), 1))
    index = {u: i for i, u in enumerate(classes)}
    y = torch.zeros(len(labels_fit), len(classes))
    for r, labs in enumerate(labels_fit):
        known = [index[lab] for lab in set(labs) if lab in index]
        if known:
            y[r, known] = 1.0 / len(known)
        else:
            y[r, 0] = 1.0
    x_tr, x_te = standardise(torch.as_tensor(np.asarray(x_fit), dtype=torch.float32),
                             torch.as_tensor(np.asarray(x_read), dtype=torch.float32))
    w, b = _fit_linear(x_tr, len(classes), lambda z: torch.nn.functional.cross_entropy(z, y), l2, steps)
    return classes, torch.softmax(x_te @ w + b, dim=-1).double().numpy()


def read_labels(x_fit: np.ndarray, labels_fit: Sequence[Sequence[str]], x_read: np.ndarray, min_count: int = 2,
                l2: float = 1e-3, steps: int = 300) -> tuple[list[str | None], np.ndarray]:
    """What a linear probe of one kind (a softmax over its labels and "none", ``_label_probs``) fitted on
    ``(x_fit, labels_fit)`` reads from each row of ``x_read``: the label it ranks first (None: "none") and
    that label's probability. With no label seen ``min_count`` times every row reads "none" (p 1)."""
    classes, prob = _label_probs(x_fit, labels_fit, x_read, min_count, l2, steps)
    top = prob.argmax(-1) if len(prob) else np.zeros(0, dtype=np.int64)
    return [classes[int(k)] for k in top], prob[np.arange(len(prob)), top] if len(prob) else np.zeros(0)


def held_labels(x: np.ndarray, labels: Sequence[Sequence[str]], groups: Sequence[int], min_prob: float,
                x_other: np.ndarray | None = None, labels_other: Sequence[Sequence[str]] | None = None,
                folds: int = 2, every_own: bool = False, **kw
                ) -> tuple[list[str | list[str] | None], list[str | list[str] | None] | None]:
    """The label each row's vector holds, as a probe of the kind that never saw the row's group says
    (``_label_probs``: a softmax over the labels and "none"): its top label when that is one of the row's
    own and the row's own labels together have probability ``>= min_prob`` (two persons share theirs), else
    None. ``every_own``: instead a list, every own label among the probe's top ``k`` (``k``: how many the
    row owns; two persons are both held where the probe ranks both first), under the same two conditions
    (empty where they fail).
    Cross-fitted as ``held_units`` (``x``: the fit rows, each read by the probe of the other folds; ``x_other``:
    read by the probe fitted on all of ``x``). A row without labels of its own holds none."""
    x, fold = np.asarray(x), _folds("held_labels", groups, folds, min_prob)

    def verdicts(classes: list[str | None], prob: np.ndarray, owns: Sequence[Sequence[str]]
                 ) -> list[str | list[str] | None]:
        out: list[str | list[str] | None] = []
        for row, own in zip(prob, owns, strict=True):
            top = classes[int(row.argmax())]
            mass = sum(q for c, q in zip(classes, row, strict=True) if c is not None and c in own)
            ok = top is not None and top in own and mass >= min_prob
            if every_own:
                first = {classes[int(i)] for i in np.argsort(-row, kind="stable")[:len(set(own))]}
                out.append(sorted(lab for lab in set(own) if lab in first) if ok else [])
            else:
                out.append(top if ok else None)
        return out

    held: list[str | list[str] | None] = [[] if every_own else None for _ in labels]
    for k in range(folds):
        fit, read = np.flatnonzero(fold != k), np.flatnonzero(fold == k)
        classes, prob = _label_probs(x[fit], [labels[i] for i in fit], x[read], **kw)
        for i, v in zip(read, verdicts(classes, prob, [labels[i] for i in read]), strict=True):
            held[i] = v
    other = None
    if x_other is not None:
        if labels_other is None or len(labels_other) != len(x_other):
            raise ValueError("held_labels: labels_other must give one label set per row of x_other")
        classes, prob = _label_probs(x, list(labels), np.asarray(x_other), **kw)
        other = verdicts(classes, prob, labels_other)
    return held, other
