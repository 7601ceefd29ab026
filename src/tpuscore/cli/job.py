"""`tpuscore job`: a table of pairs or requests scored into a table of scores (docs/jobs.md)."""

from __future__ import annotations

import argparse
import sys

from tpuscore.cli.common import EnvironmentProblem, InputError, parse_mesh, validation_message


def add_arguments(p: argparse.ArgumentParser) -> None:
    """job's own flags."""
    add = p.add_argument
    add("input", help="the table: a .parquet, .jsonl or .csv path or fsspec URL")
    add("--output", required=True, help="the scores: a .parquet (default) or .jsonl directory")
    add("--query-column", default="query", help="default: query")
    add(
        "--item-column",
        help="one item per row (pair rows) or a list of items (request rows); default: item, "
        "else items",
    )
    add("--id-columns", default="", help="comma-separated columns carried to the output")
    add("--labels", nargs="+", metavar="LABEL", help='e.g. " yes" " no"; default: per row')
    add("--label-token-ids", nargs="+", type=int, metavar="ID", help="the labels as token ids")
    add("--template", help="a prompt template, as rank takes it (plain, qwen3-reranker)")
    add("--instruction", help="the template's instruction")
    add("--max-item-tokens", type=int, help="truncate each item to this many tokens")
    add("--truncate", choices=["right", "left"], help="which end of an item to keep")
    add(
        "--chunking",
        metavar="window=N[,stride=N][,max_chunks=N][,aggregate=max|mean|first]",
        type=parse_chunking,
        help="score each item as a document by its chunks of N tokens (docs/chunking.md): the "
        "output adds chunk_score, best_chunk, chunk_start and chunk_end",
    )
    add(
        "--on-error",
        choices=["skip", "fail"],
        default="skip",
        help="skip (default): write a bad row to OUTPUT.errors.jsonl and go on; fail: stop",
    )
    add(
        "--score-calibration",
        metavar="PATH",
        help="a tpuscore fit-calibration file fitted for this model, template and labels: the "
        "output also has a calibrated column, and a resume must name the same file",
    )
    add("--shard-rows", type=int, default=4096, help="input rows per shard (default 4096)")
    add("--overwrite", action="store_true", help="start again instead of resuming OUTPUT")
    add("--progress", action="store_true", help="a progress bar even when stderr is no terminal")
    add("--quiet", action="store_true", help="no progress bar and no summary line")


def parse_chunking(text: str) -> dict[str, int | str]:
    """--chunking's key=value pairs as `Chunking`'s fields (the counts as ints); `Chunking`
    checks the names and values."""
    fields: dict[str, int | str] = {}
    for pair in text.split(","):
        key, sep, value = (part.strip() for part in pair.partition("="))
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"{pair!r} is not key=value")
        fields[key] = int(value) if value.lstrip("-").isdigit() else value
    return fields


def run(args: argparse.Namespace) -> int:
    """`tpuscore job`: checks the table and settings, loads the model, runs `score_table`."""
    try:
        from tpuscore import ValidationError, jobs
    except ImportError as e:
        raise EnvironmentProblem(
            f"tpuscore job needs the jobs extra ({e.name} is missing): pip install -e '.[jobs]'"
        ) from None
    from tpuscore.api.calibration import CalibrationMismatch
    from tpuscore.engine import compilation_cache
    from tpuscore.jobs.job import check_run

    settings = {
        "query_column": args.query_column,
        "item_column": args.item_column,
        "id_columns": [c.strip() for c in args.id_columns.split(",") if c.strip()],
        "labels": args.labels,
        "label_token_ids": args.label_token_ids,
        "template": args.template,
        "instruction": args.instruction,
        "max_item_tokens": args.max_item_tokens,
        "truncate": args.truncate,
        "chunking": args.chunking,
    }
    backend = None if args.backend == "auto" else args.backend
    try:
        # The settings and the table before the model loads (minutes for a large one).
        check_run(args.on_error, args.shard_rows)
        jobs.Spec(**settings).layout(jobs.open_table(args.input).schema)
        try:
            scorer = jobs.load_scorer(
                args.model,
                dtype=args.dtype,
                mesh=parse_mesh(args.mesh),
                profile=args.profile,
                compilation_cache_dir=compilation_cache.command_dir(args.no_compilation_cache),
                batch_invariant=args.batch_invariant,
                score_calibration=args.score_calibration,
            )
        except (ValidationError, InputError):
            raise
        except Exception as e:  # noqa: BLE001 (any load failure goes back to the --model given)
            name = "the default model" if args.model is None else repr(args.model)
            raise InputError(f"cannot load {name}: {type(e).__name__}: {e}") from None
        summary = jobs.score_table(
            args.input,
            args.output,
            scorer=scorer,
            backend=backend,
            on_error=args.on_error,
            shard_rows=args.shard_rows,
            overwrite=args.overwrite,
            show_progress=not args.quiet and (args.progress or sys.stderr.isatty()),
            **settings,
        )
    except ValidationError as e:
        # a calibration refused, or a file that is not one: named by its flag, as serve does
        flag = isinstance(e, CalibrationMismatch) or e.param == "score_calibration"
        raise InputError(f"{'--score-calibration: ' * flag}{validation_message(e)}") from None
    except (jobs.TableError, jobs.RowFailed) as e:
        raise InputError(str(e)) from None
    except KeyboardInterrupt:
        print(
            "tpuscore job: interrupted; the committed shards stay: run the same command again "
            "to resume",
            file=sys.stderr,
        )
        raise
    if not args.quiet:
        print(summary.line(), file=sys.stderr)
    return 0
