"""hbkernels.metrics: roc_auc against a brute-force pairwise count (ties one half),
logloss against the per-sample formula evaluated in plain Python."""
import math

import numpy as np
import pytest

from hbkernels.metrics import logloss, roc_auc


# -- independent references ----------------------------------------------------------------------
def pairwise_auc(labels, scores):
    """O(n^2) Mann-Whitney: over all (positive, negative) pairs, 1 when the positive
    scores higher, 1/2 on a tie; NaN without positives or negatives."""
    y = [float(v) > 0.5 for v in np.asarray(labels).tolist()]
    s = [float(v) for v in np.asarray(scores).tolist()]
    pos = [si for si, yi in zip(s, y) if yi]
    neg = [si for si, yi in zip(s, y) if not yi]
    if not pos or not neg:
        return float("nan")
    total = 0.0
    for p in pos:
        for q in neg:
            total += 1.0 if p > q else (0.5 if p == q else 0.0)
    return total / (len(pos) * len(neg))


def direct_logloss(labels, probs):
    """-mean(y log p + (1 - y) log(1 - p)), p clipped to [1e-7, 1 - 1e-7], one sample at a time."""
    y = [float(v) for v in np.asarray(labels).tolist()]
    p = [min(max(float(v), 1e-7), 1 - 1e-7) for v in np.asarray(probs).tolist()]
    if not y:
        return float("nan")
    return -sum(yi * math.log(pi) + (1 - yi) * math.log(1 - pi) for yi, pi in zip(y, p)) / len(y)


def random_labels(rng, n, positive_rate=None):
    rate = rng.uniform(0.1, 0.9) if positive_rate is None else positive_rate
    y = (rng.random(n) < rate).astype(np.int64)
    y[0], y[-1] = 0, 1  # both classes present
    return y


# -- roc_auc -------------------------------------------------------------------------------------
def test_doctest_example():
    assert roc_auc(np.array([0, 0, 1, 1]), np.array([0.1, 0.4, 0.35, 0.8])) == 0.75
    assert round(logloss(np.array([1, 0]), np.array([0.9, 0.2])), 4) == 0.1643


@pytest.mark.parametrize("n", [2, 3, 17, 250])
@pytest.mark.parametrize("levels", [None, 2, 3, 7])
def test_roc_auc_matches_pairwise(rng, n, levels):
    """Continuous scores (no ties) and scores rounded to a few values (many ties)."""
    for _ in range(3):
        y = random_labels(rng, n)
        s = rng.standard_normal(n)
        if levels is not None:
            s = rng.integers(0, levels, size=n) / (levels - 1 if levels > 1 else 1) * 0.8 + 0.1
        got = roc_auc(y, s)
        assert isinstance(got, float)
        assert got == pytest.approx(pairwise_auc(y, s), rel=1e-12, abs=1e-12)
        if levels is not None and n >= 17:
            assert len(np.unique(s)) < n  # the ties are really there


def test_roc_auc_scores_correlated_with_labels(rng):
    """A useful classifier (AUC far from 1/2) with ties between the classes."""
    n = 400
    y = random_labels(rng, n, 0.3)
    s = np.round(y * 0.7 + rng.standard_normal(n) * 0.5, 1)
    got = roc_auc(y, s)
    assert got == pytest.approx(pairwise_auc(y, s), rel=1e-12)
    assert got > 0.7


@pytest.mark.parametrize("kind", ["int", "bool", "float", "int32", "list"])
def test_roc_auc_label_types(rng, kind):
    n = 60
    y = random_labels(rng, n)
    s = np.round(rng.random(n), 1)
    expected = pairwise_auc(y, s)
    labels = {"int": y, "bool": y.astype(bool), "float": y.astype(np.float64),
              "int32": y.astype(np.int32), "list": y.tolist()}[kind]
    scores = s.tolist() if kind == "list" else s
    assert roc_auc(labels, scores) == pytest.approx(expected, rel=1e-12)


def test_roc_auc_float32_scores(rng):
    n = 100
    y = random_labels(rng, n)
    s = rng.random(n).astype(np.float32)
    assert roc_auc(y, s) == pytest.approx(pairwise_auc(y, s), rel=1e-12)


@pytest.mark.parametrize("ties", [False, True])
def test_roc_auc_invariant_to_monotone_transforms(rng, ties):
    n = 150
    y = random_labels(rng, n)
    s = rng.uniform(-3, 3, size=n)
    if ties:
        s = np.round(s)
    base = roc_auc(y, s)
    assert base == pytest.approx(pairwise_auc(y, s), rel=1e-12)
    transformed = [np.exp(s), 3.0 * s - 7.0, 1.0 / (1.0 + np.exp(-s)), s ** 3,
                   np.argsort(np.argsort(s, kind="stable"), kind="stable") if not ties else np.round(s) * 10]
    for t in transformed:
        assert roc_auc(y, t) == pytest.approx(base, rel=1e-12)
    # a decreasing transform gives 1 - AUC; permuting the samples changes nothing
    assert roc_auc(y, -s) == pytest.approx(1.0 - base, rel=1e-12, abs=1e-12)
    perm = rng.permutation(n)
    assert roc_auc(y[perm], s[perm]) == pytest.approx(base, rel=1e-12)


def test_roc_auc_extremes():
    y = np.array([0, 0, 0, 1, 1])
    assert roc_auc(y, np.array([0.1, 0.2, 0.3, 0.4, 0.5])) == 1.0
    assert roc_auc(y, np.array([0.5, 0.4, 0.3, 0.2, 0.1])) == 0.0
    assert roc_auc(y, np.full(5, 0.3)) == 0.5  # all tied
    # one positive tied with one of two negatives, above the other: (1 + 0.5) / 2
    assert roc_auc(np.array([0, 1, 0]), np.array([0.2, 0.5, 0.5])) == 0.75


@pytest.mark.parametrize("labels", [[], [0], [1], [0, 0, 0], [1, 1], [True, True], [0.0, 0.0]])
def test_roc_auc_nan_without_both_classes(labels):
    scores = np.linspace(0.1, 0.9, len(labels))
    assert math.isnan(roc_auc(np.array(labels), scores))


def test_roc_auc_empty_arrays():
    assert math.isnan(roc_auc(np.array([], np.int64), np.array([], np.float64)))
    assert math.isnan(roc_auc([], []))


# -- logloss -------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 33, 500])
def test_logloss_matches_direct_formula(rng, n):
    y = (rng.random(n) < 0.4).astype(np.int64)
    p = rng.uniform(0.001, 0.999, size=n)
    got = logloss(y, p)
    assert isinstance(got, float)
    assert got == pytest.approx(direct_logloss(y, p), rel=1e-12)
    assert got > 0


def test_logloss_label_types(rng):
    n = 40
    y = random_labels(rng, n)
    p = rng.random(n)
    expected = direct_logloss(y, p)
    for labels in (y, y.astype(bool), y.astype(np.float32), y.tolist()):
        assert logloss(labels, p) == pytest.approx(expected, rel=1e-12)
    assert logloss(y, p.astype(np.float32)) == pytest.approx(
        direct_logloss(y, p.astype(np.float32)), rel=1e-12)


def test_logloss_clips_probabilities_of_zero_and_one(rng):
    # right answers with certainty: -log(1 - 1e-7) each; wrong ones: -log(1e-7) each
    y = np.array([1, 0, 1, 0])
    p = np.array([1.0, 0.0, 0.0, 1.0])
    got = logloss(y, p)
    assert math.isfinite(got)
    assert got == pytest.approx(direct_logloss(y, p), rel=1e-12)
    # (1 - 1e-7 is not exact in float64: 1 - it is 1e-7 to about 1e-9 relative)
    assert got == pytest.approx((2 * -math.log1p(-1e-7) + 2 * -math.log(1e-7)) / 4, rel=1e-9)
    assert logloss([1, 0], [1.0, 0.0]) == pytest.approx(-math.log1p(-1e-7), rel=1e-9)
    assert logloss([1], [0.0]) == pytest.approx(-math.log(1e-7), rel=1e-12)
    assert logloss([0], [1.0]) == pytest.approx(-math.log(1e-7), rel=1e-9)
    # out-of-range probabilities clip the same way
    assert logloss([1, 0], [2.0, -1.0]) == pytest.approx(logloss([1, 0], [1.0, 0.0]), rel=1e-12)
    # random data with exact 0s and 1s mixed in
    n = 200
    y = (rng.random(n) < 0.5).astype(np.int64)
    p = rng.random(n)
    p[rng.random(n) < 0.2] = 0.0
    p[rng.random(n) < 0.2] = 1.0
    got = logloss(y, p)
    assert math.isfinite(got)
    assert got == pytest.approx(direct_logloss(y, p), rel=1e-12)


def test_logloss_soft_labels(rng):
    y = rng.random(50)
    p = rng.random(50)
    assert logloss(y, p) == pytest.approx(direct_logloss(y, p), rel=1e-12)


def test_logloss_empty_is_nan():
    assert math.isnan(logloss(np.array([]), np.array([])))
    assert math.isnan(logloss([], []))


@pytest.mark.parametrize("metric", [logloss, roc_auc])
def test_mismatched_lengths_and_nan_scores_are_value_errors(metric):
    with pytest.raises(ValueError, match="3 labels but 1"):
        metric([1, 0, 1], [0.5])
    with pytest.raises(ValueError, match="NaN"):
        metric([0, 1, 0, 1], [0.1, float("nan"), 0.3, 0.4])
