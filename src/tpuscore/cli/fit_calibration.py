"""`tpuscore fit-calibration`: fit a score calibration on labelled examples (docs/calibration.md).

    tpuscore fit-calibration examples.jsonl --out smollm2-plain.json
    tpuscore serve --score-calibration smollm2-plain.json

The input is JSON Lines (or Parquet, with the jobs extra) of labelled pairs, one row per pair:
`{"query": ..., "item": ..., "label": 1}` (label 1/true: the item is relevant/positive). Every
pair is scored as `Scorer.rank` scores it (under --template, default the server's "plain"; or
with --labels as `Scorer.score` does), the calibration fitted on one split, and the expected
calibration error and Brier score of the raw and the calibrated probabilities reported on the
held-out rest. The file written is what `Scorer.from_pretrained(..., score_calibration=)` and
`tpuscore serve --score-calibration` load.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from tpuscore.api.calibration import METHODS


def add_arguments(p: argparse.ArgumentParser) -> None:
    add = p.add_argument
    add("input", help="labelled pairs: a .jsonl (or .parquet) file of query, item, label rows")
    add("--out", required=True, help="the calibration file to write (JSON)")
    add(
        "--template",
        help="the prompt template the scores come from (plain, qwen3-reranker); default: plain, "
        "the server's default --rerank-template, unless --labels or --label-token-ids are given",
    )
    add(
        "--labels",
        nargs="+",
        metavar="LABEL",
        help='score with these labels, no template: " yes" " no"',
    )
    add("--label-token-ids", nargs="+", type=int, metavar="ID", help="the labels as token ids")
    add(
        "--positive",
        type=int,
        help="the positive label's index (default: 0; on a classification model its last class)",
    )
    add("--method", default="auto", choices=("auto", *METHODS), help="default auto: the lowest "
        "cross-validated Brier score on the fitting split")  # fmt: skip
    add("--test-fraction", type=float, default=0.25, help="held out for the report (0.25)")
    add("--seed", type=int, default=0, help="seeds the split and the folds")
    add("--query-column", default="query")
    add("--item-column", default="item")
    add("--label-column", default="label")


def read_rows(path: str, columns: list[str]) -> list[list[Any]]:
    """The columns of every row of a JSON Lines or Parquet file."""
    from tpuscore.cli.common import EnvironmentProblem, InputError

    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise EnvironmentProblem(
                "Parquet input needs the jobs extra: pip install -e '.[jobs]'"
            ) from None
        table = pq.read_table(path, columns=columns)
        return [table.column(c).to_pylist() for c in columns]
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise InputError(f"cannot read {path}: {e}") from None
    values: list[list[Any]] = [[] for _ in columns]
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            for c, column in zip(columns, values, strict=True):
                column.append(row[c])
        except (ValueError, KeyError, TypeError) as e:
            raise InputError(f"{path}:{n}: not a row with {', '.join(columns)}: {e!r}") from None
    return values


def run(args: argparse.Namespace) -> int:
    from tpuscore.api import calibration, templates
    from tpuscore.api.errors import ValidationError
    from tpuscore.api.requests import ScoreOptions
    from tpuscore.cli.common import InputError, load_scorer
    from tpuscore.engine import calibration as engine_calibration
    from tpuscore.tasks import calibrated

    columns = [args.query_column, args.item_column, args.label_column]
    queries, items, labels = read_rows(args.input, columns)  # before the model loads
    labels = [int(v) if isinstance(v, bool) else v for v in labels]
    given = args.labels is not None or args.label_token_ids is not None
    if given and args.template is not None:
        raise InputError("give --template or --labels/--label-token-ids, not both")
    scorer = load_scorer(args)
    classes = scorer.config.num_labels
    try:
        template = None if given else templates.get(args.template or "plain")
        options = ScoreOptions(labels=args.labels, label_token_ids=args.label_token_ids)
        request, rows = calibrated.score_examples(scorer.engine, queries, items, options, template)
        positive = args.positive if args.positive is not None else max(classes - 1, 0)
        z = calibration.log_odds(np.stack(rows), positive, request.classification)
        fitted = calibration.fit(
            z, labels, method=args.method, test_fraction=args.test_fraction, seed=args.seed,
            model=engine_calibration.model_fingerprint(scorer.engine.model),
            template=None if template is None else template.name,
            label_token_ids=request.label_ids,
            labels=list(template.labels) if template and not classes else args.labels,
            positive=positive, classification=request.classification,
        )  # fmt: skip
    except (ValidationError, ValueError) as e:
        raise InputError(str(e)) from None
    fitted.save(args.out)
    held = fitted.metrics["held_out"]
    print(
        f"tpuscore: {fitted.method} calibration written to {args.out}; on {held['examples']} "
        f"held-out examples: ECE {held['raw_ece']:.4f} -> {held['ece']:.4f}, "
        f"Brier {held['raw_brier']:.4f} -> {held['brier']:.4f}",
        file=sys.stderr,
    )
    print(json.dumps({"out": args.out, "method": fitted.method, **fitted.metrics}))
    return 0
