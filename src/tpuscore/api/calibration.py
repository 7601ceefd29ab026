"""Score calibration: a map from a scored item's label log-probabilities to a probability that
means what it says (of items given 0.8, about 80% are positive), fitted on labelled examples.

The feature is the positive label's log-odds within the labels, z = log P(pos) - log sum of the
other labels' P (for a classification model, over its classes; a single class's logit as is).
Its sigmoid is the raw score `Scorer.rank` returns. The methods map z to a probability:

- temperature: sigmoid(z / T), one parameter; keeps the ranking and the 0.5 point.
- platt: sigmoid(a z + b) (Platt, 1999), two parameters; also moves the 0.5 point.
- isotonic: a non-decreasing step fit of the labels on z (pool adjacent violators), linearly
  interpolated between its knots; many parameters, so it needs more examples to pay.

`fit` fits every method on one split, picks the one with the lowest Brier score in k-fold
cross-validation within that split (`method="auto"`), and reports the expected calibration error
(ECE) and Brier score of the raw and the calibrated probabilities on a held-out split. A
`Calibration` records what it was fitted for (the model's fingerprint, the template, the labels);
`check` refuses it for anything else with `calibration_mismatch`. Pure numpy and scipy.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs
import numpy as np
import scipy.special

from tpuscore.api.bounds import is_token_id
from tpuscore.api.errors import ValidationError

FORMAT = "tpuscore-score-calibration/1"
Method = Literal["temperature", "platt", "isotonic"]
METHODS: tuple[Method, ...] = ("temperature", "platt", "isotonic")
ECE_BINS = 15
CV_FOLDS = 5
# Probabilities are kept this far from 0 and 1 in the log-loss, so one confident miss is finite.
EPS = 1e-7


class CalibrationMismatch(ValidationError):
    """A calibration fitted for another model, template or labels than it is applied to."""

    def __init__(self, message: str, param: str = "score_calibration"):
        super().__init__("calibration_mismatch", message, param)


# -- the feature and the metrics ---------------------------------------------------------------


def log_odds(logprobs: np.ndarray, positive: int = 0, classification: bool = False) -> np.ndarray:
    """z [items]: the positive label's log-odds within the labels of logprobs [items, labels]."""
    x = np.asarray(logprobs, np.float64)
    if x.ndim != 2 or not 0 <= positive < x.shape[1]:
        raise ValueError(f"logprobs {x.shape} has no label {positive}")
    if x.shape[1] == 1:  # one class's logit, or one label's log P over the whole vocabulary
        return x[:, 0] if classification else x[:, 0] - np.log1p(-np.exp(np.minimum(x[:, 0], -EPS)))
    others = np.delete(x, positive, axis=1)
    return x[:, positive] - scipy.special.logsumexp(others, axis=1)


def expected_calibration_error(
    probs: np.ndarray, labels: np.ndarray, bins: int = ECE_BINS
) -> float:
    """ECE over `bins` equal-width bins of the predicted probability: the item-weighted mean of
    |fraction positive - mean prediction| per bin (Naeini et al., 2015; Guo et al., 2017)."""
    p, y = np.asarray(probs, np.float64), np.asarray(labels, np.float64)
    which = np.minimum((p * bins).astype(np.int64), bins - 1)
    total = 0.0
    for b in range(bins):
        in_bin = which == b
        if in_bin.any():
            total += in_bin.sum() * abs(y[in_bin].mean() - p[in_bin].mean())
    return float(total / len(p))


def brier_score(probs: np.ndarray, labels: np.ndarray) -> float:
    """Mean squared difference between the predicted probability and the 0/1 label."""
    return float(np.mean((np.asarray(probs, np.float64) - np.asarray(labels, np.float64)) ** 2))


def _log_loss(probs: np.ndarray, labels: np.ndarray) -> float:
    p = np.clip(probs, EPS, 1 - EPS)
    return float(-np.mean(labels * np.log(p) + (1 - labels) * np.log1p(-p)))


# -- the methods ---------------------------------------------------------------------------------


def _fit_temperature(z: np.ndarray, y: np.ndarray) -> dict[str, Any]:
    import scipy.optimize  # fitting only: not on the import path of every scorer

    def loss(log_t: float) -> float:
        return _log_loss(scipy.special.expit(z / np.exp(log_t)), y)

    best = scipy.optimize.minimize_scalar(loss, bounds=(-7.0, 7.0), method="bounded")
    return {"temperature": float(np.exp(best.x))}


def _fit_platt(z: np.ndarray, y: np.ndarray) -> dict[str, Any]:
    import scipy.optimize

    def loss_and_grad(ab: np.ndarray) -> tuple[float, np.ndarray]:
        p = np.clip(scipy.special.expit(ab[0] * z + ab[1]), EPS, 1 - EPS)
        residual = (p - y) / len(z)  # d(mean log-loss)/d(logit)
        return _log_loss(p, y), np.array([residual @ z, residual.sum()])

    best = scipy.optimize.minimize(loss_and_grad, np.array([1.0, 0.0]), jac=True, method="L-BFGS-B")
    return {"a": float(best.x[0]), "b": float(best.x[1])}


def _fit_isotonic(z: np.ndarray, y: np.ndarray) -> dict[str, Any]:
    import scipy.optimize

    order = np.argsort(z, kind="stable")
    zs, fitted = z[order], scipy.optimize.isotonic_regression(y[order]).x
    # Knots: each constant block's first and last z; np.interp joins the blocks linearly.
    keep = np.ones(len(zs), bool)
    keep[1:-1] = (fitted[1:-1] != fitted[:-2]) | (fitted[1:-1] != fitted[2:])
    return {"z": zs[keep].tolist(), "p": fitted[keep].tolist()}


FITTERS = {"temperature": _fit_temperature, "platt": _fit_platt, "isotonic": _fit_isotonic}


def apply_method(method: str, parameters: Mapping[str, Any], z: np.ndarray) -> np.ndarray:
    """The calibrated probability [items] of log-odds z [items] under a fitted method."""
    z = np.asarray(z, np.float64)
    if method == "temperature":
        return scipy.special.expit(z / parameters["temperature"])
    if method == "platt":
        return scipy.special.expit(parameters["a"] * z + parameters["b"])
    if method == "isotonic":
        return np.interp(z, parameters["z"], parameters["p"])
    raise ValueError(f"unknown calibration method {method!r}; known: {', '.join(METHODS)}")


# -- fitting -----------------------------------------------------------------------------------


@attrs.frozen
class Metrics:
    """ECE and Brier score of the raw and the calibrated probabilities on `examples` items."""

    examples: int
    raw_ece: float
    raw_brier: float
    ece: float
    brier: float


def split(n: int, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(fit indexes, held-out indexes): a seeded random split, each side non-empty."""
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    order = np.random.default_rng(seed).permutation(n)
    n_test = min(max(1, round(n * test_fraction)), n - 1)
    return np.sort(order[n_test:]), np.sort(order[:n_test])


def choose_method(z: np.ndarray, y: np.ndarray, seed: int = 0) -> tuple[Method, dict[str, float]]:
    """The method with the lowest mean Brier score over CV_FOLDS folds of (z, y), and every
    method's; ties go to the method listed first (the simpler)."""
    folds = np.array_split(np.random.default_rng(seed).permutation(len(z)), CV_FOLDS)
    briers = {}
    for method in METHODS:
        scores = []
        for k, held in enumerate(folds):
            train = np.concatenate([f for j, f in enumerate(folds) if j != k])
            fitted = FITTERS[method](z[train], y[train])
            scores.append(brier_score(apply_method(method, fitted, z[held]), y[held]))
        briers[method] = float(np.mean(scores))
    return min(METHODS, key=lambda m: briers[m]), briers


def evaluate(method: str, parameters: Mapping[str, Any], z: np.ndarray, y: np.ndarray) -> Metrics:
    raw, calibrated = scipy.special.expit(z), apply_method(method, parameters, z)
    return Metrics(
        examples=len(z),
        raw_ece=expected_calibration_error(raw, y),
        raw_brier=brier_score(raw, y),
        ece=expected_calibration_error(calibrated, y),
        brier=brier_score(calibrated, y),
    )


def check_outcomes(y: Any) -> np.ndarray:
    y = np.asarray(y)
    if y.ndim != 1 or not np.isin(y, (0, 1)).all():
        raise ValidationError("invalid_argument", "labels must be 0/1 (or false/true)", "label")
    if len(y) < 2 * CV_FOLDS or y.min() == y.max():
        raise ValidationError(
            "invalid_argument",
            f"calibration needs at least {2 * CV_FOLDS} labelled examples of both classes, got "
            f"{len(y)} with {int(y.sum())} positive",
            "label",
        )
    return y.astype(np.float64)


# -- the file ------------------------------------------------------------------------------------


def fingerprint(config: Mapping[str, Any], arrays: Sequence[np.ndarray]) -> str:
    """A model's identity: its config and the given weights rounded to bfloat16 (so a float32
    and a bfloat16 load of one checkpoint agree, and different weights do not)."""
    import ml_dtypes  # a dependency of jax

    digest = hashlib.blake2b(digest_size=16)
    digest.update(json.dumps(dict(config), sort_keys=True, default=str).encode())
    for array in arrays:
        digest.update(np.ascontiguousarray(np.asarray(array).astype(ml_dtypes.bfloat16)).tobytes())
    return digest.hexdigest()


@attrs.frozen(kw_only=True)
class Calibration:
    """A fitted calibration and what it was fitted for.

    Attributes:
        model: the model's `fingerprint`.
        template: the prompt template the examples were rendered with, or None.
        label_token_ids: the labels as token ids (class indices for a classification model).
        labels: the labels as given, when given as text (for messages only).
        positive: the index of the positive label.
        classification: whether the scores are a classification head's logits.
        method, parameters: the fitted map (`apply_method`).
        metrics: what `fit` measured (held-out ECE and Brier before and after, CV Briers).
    """

    model: str
    template: str | None
    label_token_ids: tuple[int, ...] = attrs.field(converter=tuple)
    labels: tuple[str, ...] | None = attrs.field(
        default=None, converter=lambda v: None if v is None else tuple(v)
    )
    positive: int = 0
    classification: bool = False
    method: Method
    parameters: Mapping[str, Any]
    metrics: Mapping[str, Any] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        """Refuse (ValueError) fields no fit writes: loaded, they failed or gave NaN only when a
        request the calibration covers was scored."""
        labels = self.label_token_ids
        if not labels or not all(is_token_id(t) for t in labels):
            raise ValueError(f"label_token_ids must be token ids, got {list(labels)}")
        positive = self.positive
        if not is_token_id(positive) or not 0 <= positive < len(labels):
            raise ValueError(f"positive must index one of {len(labels)} labels, got {positive!r}")
        if not isinstance(self.classification, bool):
            raise ValueError(f"classification must be a bool, got {self.classification!r}")
        probe = apply_method(self.method, self.parameters, np.linspace(-30.0, 30.0, 13))
        if not np.all((probe >= 0) & (probe <= 1)):  # NaN fails too
            raise ValueError(
                f"{self.method} parameters {dict(self.parameters)} give no probability"
            )

    def covers(self, label_ids: Sequence[int], classification: bool) -> bool:
        """Whether a request with these labels is one this calibration was fitted for."""
        return tuple(label_ids) == self.label_token_ids and classification == self.classification

    def probabilities(self, logprobs: np.ndarray) -> np.ndarray:
        """Calibrated P(positive) [items], read-only float32, from logprobs [items, labels]."""
        z = log_odds(logprobs, self.positive, self.classification)
        p = apply_method(self.method, self.parameters, z).astype(np.float32)
        p.setflags(write=False)
        return p

    def check(
        self, *, model: str | None = None, template: str | None = None, label_token_ids=None
    ) -> None:
        """Refuse (`CalibrationMismatch`) a model, template or labels other than the fitted
        (model and label_token_ids None: not checked)."""
        if model is not None and model != self.model:
            raise CalibrationMismatch(
                f"this calibration was fitted for another model (fingerprint {self.model}, "
                f"this model's is {model}); fit one for it with tpuscore fit-calibration"
            )
        if template != self.template:
            raise CalibrationMismatch(
                f"this calibration was fitted for template {self.template!r}, not {template!r}",
                "template",
            )
        if label_token_ids is not None and tuple(label_token_ids) != self.label_token_ids:
            raise CalibrationMismatch(
                f"this calibration was fitted for labels {self._label_text()}, not token ids "
                f"{list(label_token_ids)}",
                "labels",
            )

    def _label_text(self) -> str:
        ids = list(self.label_token_ids)
        return f"{list(self.labels)} (token ids {ids})" if self.labels else f"token ids {ids}"

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, **attrs.asdict(self, recurse=False)} | {
            "label_token_ids": list(self.label_token_ids),
            "labels": None if self.labels is None else list(self.labels),
            "parameters": dict(self.parameters),
            "metrics": dict(self.metrics),
        }

    def save(self, path: str | os.PathLike) -> None:
        text = json.dumps(self.to_json(), indent=2) + "\n"
        tmp = f"{os.fspath(path)}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Calibration:
        """The calibration in a file `save` wrote; anything else is `invalid_calibration`."""

        def invalid(why: str) -> ValidationError:
            return ValidationError(
                "invalid_calibration", f"{os.fspath(path)} {why}", "score_calibration"
            )

        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            raise invalid(f"cannot be read as JSON: {e}") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise invalid(f"is not a score calibration (its format is not {FORMAT!r})")
        data.pop("format")
        try:
            calibration = cls(**data)  # its fields checked (`__attrs_post_init__`)
        except (TypeError, ValueError, KeyError) as e:
            raise invalid(f"is malformed: {type(e).__name__}: {e}") from None
        return calibration


def fit(
    z: np.ndarray,
    outcomes: Any,
    *,
    method: Method | Literal["auto"] = "auto",
    test_fraction: float = 0.25,
    seed: int = 0,
    **fitted_for: Any,
) -> Calibration:
    """Fit a `Calibration` of log-odds z [n] to 0/1 outcomes [n] on a seeded split; fitted_for:
    `Calibration`'s model, template, label_token_ids, labels, positive, classification."""
    y = check_outcomes(outcomes)
    z = np.asarray(z, np.float64)
    if z.shape != y.shape or not np.isfinite(z).all():
        raise ValueError(f"z {z.shape} must be finite and match the labels {y.shape}")
    train, held = split(len(y), test_fraction, seed)
    chosen, briers = choose_method(z[train], y[train], seed)
    if method != "auto":
        if method not in METHODS:
            raise ValidationError(
                "invalid_argument",
                f"method must be auto or one of {', '.join(METHODS)}, got {method!r}",
                "method",
            )
        chosen = method
    parameters = FITTERS[chosen](z[train], y[train])
    metrics = evaluate(chosen, parameters, z[held], y[held])
    return Calibration(
        method=chosen,
        parameters=parameters,
        metrics={
            "fitted_examples": len(train),
            "held_out": attrs.asdict(metrics),
            "cv_brier": briers,
        },
        **fitted_for,
    )
