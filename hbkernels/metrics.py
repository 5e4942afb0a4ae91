"""Metrics of binary classifiers over a whole evaluation set (NumPy, float64).

``logloss = -mean(y log p + (1 - y) log(1 - p))`` with ``p`` clipped to
``[1e-7, 1 - 1e-7]``; ``roc_auc`` is the Mann-Whitney statistic: the
probability that a random positive scores above a random negative, ties
counting one half (average ranks), as ``sklearn.metrics.roc_auc_score``.
Labels and scores of different lengths, or NaN scores, raise ``ValueError``.

>>> import numpy as np
>>> roc_auc(np.array([0, 0, 1, 1]), np.array([0.1, 0.4, 0.35, 0.8]))
0.75
>>> round(logloss(np.array([1, 0]), np.array([0.9, 0.2])), 4)
0.1643
"""
import numpy as np

EPS = 1e-7


def _checked(labels, scores, what):
    y = np.asarray(labels, np.float64).reshape(-1)
    s = np.asarray(scores, np.float64).reshape(-1)
    if y.shape != s.shape:
        raise ValueError(f"{len(y)} labels but {len(s)} {what}")
    if np.isnan(s).any():
        raise ValueError(f"{what} contain NaN")
    return y, s


def logloss(labels, probs):
    y, p = _checked(labels, probs, "probabilities")
    p = np.clip(p, EPS, 1 - EPS)
    if y.size == 0:
        return float("nan")
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log1p(-p)))


def roc_auc(labels, scores):
    """Area under the ROC curve; NaN when there are no positives or no negatives."""
    y, s = _checked(labels, scores, "scores")
    y = y > 0.5
    positives = int(y.sum())
    negatives = y.size - positives
    if positives == 0 or negatives == 0:
        return float("nan")
    order = np.argsort(s, kind="stable")
    sorted_scores = s[order]
    # average rank (1-based) of each run of equal scores
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], s.size]
    run_rank = (starts + ends + 1) / 2.0
    ranks = np.empty(s.size, np.float64)
    ranks[order] = np.repeat(run_rank, ends - starts)
    u = ranks[y].sum() - positives * (positives + 1) / 2.0
    return float(u / (positives * negatives))
