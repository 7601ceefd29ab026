"""The `tpuscore` command: score, rank and loglikelihood over JSON; serve; bench; calibrate;
cache.

    echo '{"query": "The capital of France is", "items": [""], "labels": [" Paris"]}' \\
        | tpuscore score
    tpuscore score requests.jsonl > results.jsonl
    tpuscore rank --model Qwen/Qwen3-Reranker-0.6B query.json
    tpuscore loglikelihood questions.jsonl
    tpuscore serve --port 8000
    tpuscore bench
    tpuscore calibrate --out my-device.json
    tpuscore cache size
    tpuscore fit-calibration labelled.jsonl --out scores.json

Input is read from a file, or from stdin when the file is "-" or left out. It is JSON, one
request object or a list of them, or JSON Lines, one request object per line. A request object
holds the keyword arguments of the matching Python method (`Scorer.score`, `Scorer.rank`,
`Scorer.loglikelihood`); a score request's are query, items and `ScoreOptions`' fields. Output
is JSON on stdout: one result object for one request object, a list for a list, one result per
line for JSON Lines.

Every request is checked before any runs, and no result is written unless all succeed. Bad
input (a missing file, malformed JSON, an unknown field, a `ValidationError`) prints one line on
stderr and exits with status 2, as argparse does for a bad command line; a model that cannot be
loaded does too. Status 1 means an environment problem: a missing extra, or no benchmark script.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from tpuscore.api.errors import ValidationError
from tpuscore.api.requests import SCORE_ARGUMENTS, ScoreOptions
from tpuscore.api.results import ScoreResult
from tpuscore.cli import cache, job, serve
from tpuscore.cli.common import (
    ENVIRONMENT_ERROR,
    USAGE_ERROR,
    EnvironmentProblem,
    InputError,
    load_scorer,
    validation_message,
)
from tpuscore.tasks.chunking import ChunkedResult


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (the console script exits with it)."""
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "calibrate":  # its own flags and --help: `tpuscore.cli.calibrate`
        from tpuscore.cli import calibrate

        return calibrate.main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args)
    except InputError as e:
        return _fail(str(e), USAGE_ERROR)
    except EnvironmentProblem as e:
        return _fail(str(e), ENVIRONMENT_ERROR)
    except KeyboardInterrupt:
        return 130


def _fail(message: str, status: int) -> int:
    print(f"tpuscore: error: {message}", file=sys.stderr)
    return status


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    add = common.add_argument
    add(
        "--model",
        help="a Hugging Face directory or hub id, a .gguf file, a directory written by "
        "Scorer.save; default: the embedded SmolLM2-135M-Instruct",
    )
    add(
        "--dtype",
        choices=["float32", "bfloat16", "mixed", "int8"],
        help="default: float32 on CPU, bfloat16 on accelerators; mixed: bfloat16 matmul "
        "operands, float32 everywhere else; int8: int8 projection and MLP matmuls with float32 "
        "outlier channels, one device only (docs/runtime.md#precision)",
    )
    add("--backend", default="auto", help="a registered backend name (default: auto)")
    add(
        "--mesh",
        metavar="DATAxMODEL",
        help='shard over the first DATA*MODEL devices, e.g. "8x1" (data parallel) or "2x4" '
        "(docs/sharding.md); default: one device",
    )
    add(
        "--profile",
        metavar="PATH",
        help="a device profile for auto (tpuscore calibrate writes one); default: the built-in "
        "one for this device kind",
    )
    add(
        "--batch-invariant",
        action="store_true",
        help="a request's scores bit-identical whatever shares its batch (prefill_extend, serial "
        "and reference only; docs/batch-invariance.md)",
    )
    add("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    add(
        "--no-compilation-cache",
        action="store_true",
        help="compile afresh, without JAX's persistent compilation cache (default: on, in the "
        "user cache directory; TPUSCORE_COMPILATION_CACHE=DIR moves it, =off turns it off)",
    )

    # The shared options go on each subcommand only: on the main parser too, a subcommand's
    # defaults would overwrite what was given before it.
    parser = argparse.ArgumentParser(prog="tpuscore", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    def command(name: str, run: Callable[[argparse.Namespace], int], help: str):
        p = sub.add_parser(name, parents=[common], help=help, description=help)
        p.set_defaults(run=run, command=name)
        return p

    for name, help in [
        ("score", "log P(label | query + item) for each request (Scorer.score's fields)"),
        ("rank", "items sorted by score for each request (Scorer.rank's fields)"),
        (
            "loglikelihood",
            "log P(continuation | context) for each request "
            "(Scorer.loglikelihood's fields: context, continuations)",
        ),
    ]:
        p = command(name, _run_requests, help)
        p.add_argument(
            "input", nargs="?", default="-", help="JSON or JSON Lines file; default or '-': stdin"
        )

    serve.add_arguments(
        command("serve", serve.run, "serve SGLang's /v1/score and the rerank API over HTTP")
    )
    help = (
        "score a Parquet, JSON Lines or CSV table of pairs or requests into a table of scores, "
        "resuming after a crash (docs/jobs.md)"
    )
    job.add_arguments(command("job", job.run, help))

    p = command(
        "bench",
        _run_bench,
        "run benchmarks/bench.py (quick mode unless --full) "
        "from a source checkout, on the embedded default model",
    )
    p.add_argument("--full", action="store_true", help="every geometry, not the quick mode")
    p.add_argument("--script", type=Path, help="the bench.py to run (default: the checkout's)")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="passed on to bench.py")

    cache.add_parser(sub, _run_cache)
    from tpuscore.cli import fit_calibration

    help = "fit a score calibration on labelled pairs (docs/calibration.md)"
    fit_calibration.add_arguments(command("fit-calibration", fit_calibration.run, help))

    help = "fit a device profile for auto on this machine (tpuscore calibrate --help)"
    p = sub.add_parser("calibrate", add_help=False, help=help, description=help)
    p.set_defaults(command="calibrate", log_level="warning")
    return parser


# ---------------------------------------------------------------------------------------------
# score, rank, loglikelihood


@attrs.frozen
class Request:
    """One request object and where it came from, for error messages."""

    where: str
    fields: dict[str, Any]


def read_requests(text: str, source: str) -> tuple[list[Request], str]:
    """The request objects in `text`, and the input's shape: "object", "list" or "lines".

    A text that parses as one JSON value is JSON; otherwise, if its first line parses alone,
    it is JSON Lines, one object per non-blank line.
    """
    if not text.strip():
        raise InputError(f"{source}: no input (expected JSON or JSON Lines)")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as whole:
        lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
        if len(lines) < 2 or not _parses(lines[0][1]):
            raise InputError(f"{source}: invalid JSON: {whole}") from None
        requests = []
        for n, line in lines:
            where = f"{source}, line {n}"
            try:
                requests.append(Request(where, _object(json.loads(line), where)))
            except json.JSONDecodeError as e:
                raise InputError(f"{where}: invalid JSON: {e.msg} (column {e.colno})") from None
        return requests, "lines"
    if isinstance(value, list):
        where = [f"{source}, request {i}" for i in range(len(value))]
        return [Request(w, _object(v, w)) for w, v in zip(where, value, strict=True)], "list"
    return [Request(source, _object(value, source))], "object"


def _parses(line: str) -> bool:
    try:
        json.loads(line)
    except json.JSONDecodeError:
        return False
    return True


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InputError(f"{where}: a request must be a JSON object, got {type(value).__name__}")
    return value


def _read_input(path: str) -> tuple[str, str]:
    """(text, name for messages) of a file, or of stdin for "-"."""
    if path == "-":
        data, source = sys.stdin.buffer.read(), "<stdin>"
    else:
        try:
            data, source = Path(path).read_bytes(), path
        except OSError as e:
            raise InputError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8"), source
    except UnicodeDecodeError as e:
        raise InputError(f"{source}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _run_requests(args: argparse.Namespace) -> int:
    text, source = _read_input(args.input)
    requests, shape = read_requests(text, source)  # before the model loads: fail fast
    scorer = load_scorer(args)
    outputs = COMMANDS[args.command](scorer, requests)
    if shape == "object":
        print(_dumps(outputs[0]))
    elif shape == "list":
        print(_dumps(outputs))
    else:
        sys.stdout.write("".join(_dumps(out) + "\n" for out in outputs))
    return 0


def _score(scorer, requests: list[Request]) -> list[dict[str, Any]]:
    """All requests validated first, then run together: requests sharing a query share work. A
    request with `chunking` scores its items as documents by their chunks (`ChunkedResult`)."""

    def prepare(**fields: Any):
        return scorer.prepare_request(fields)

    accepted = (*SCORE_ARGUMENTS, "chunking")
    prepared = [_call(request, prepare, accepted, "Scorer.score") for request in requests]
    try:
        results = scorer.run(prepared)
    except ValidationError as e:  # a backend that cannot run these requests
        raise InputError(validation_message(e)) from None
    return [_scored(r) if isinstance(r, ScoreResult) else _documents(r) for r in results]


def _scored(result: ScoreResult) -> dict[str, Any]:
    calibrated = result.calibrated
    return {
        "scores": result.scores.tolist(),
        "logprobs": result.logprobs.tolist(),
        "backend": result.backend,
        "num_tokens": result.num_tokens,
        **({} if calibrated is None else {"calibrated": calibrated.tolist()}),
    }


def _documents(result: ChunkedResult) -> dict[str, Any]:
    """A chunked request's output: per document its score, best chunk and its span, and its
    chunks' scores; `chunks`, every chunk's output as an unchunked request's."""
    return {
        "scores": result.scores.tolist(),
        "best_chunk": result.best_chunk.tolist(),
        "best_span": [list(span) for span in result.best_span],
        "chunk_scores": [scores.tolist() for scores in result.chunk_scores],
        "spans": [list(span) for span in result.spans],
        "chunks": _scored(result.chunks),
    }


def _rank(scorer, requests: list[Request]) -> list[dict[str, Any]]:
    accepted = (*_parameters(scorer.rank), *ScoreOptions.names())
    outputs = []
    for request in requests:
        ranked = _call(request, scorer.rank, accepted, "Scorer.rank")
        outputs.append({"results": [_jsonable(item) for item in ranked]})
    return outputs


def _loglikelihood(scorer, requests: list[Request]) -> list[dict[str, Any]]:
    accepted = _parameters(scorer.loglikelihood)
    outputs = []
    for request in requests:
        results = _call(request, scorer.loglikelihood, accepted, "Scorer.loglikelihood")
        outputs.append({"results": [_jsonable(r) for r in results]})
    return outputs


COMMANDS = {"score": _score, "rank": _rank, "loglikelihood": _loglikelihood}


def _parameters(method: Callable[..., Any]) -> tuple[str, ...]:
    """A method's named parameters (not its **options)."""
    kinds = (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    return tuple(n for n, p in inspect.signature(method).parameters.items() if p.kind not in kinds)


def _call(request: Request, method: Callable[..., Any], accepted: Sequence[str], what: str) -> Any:
    """method(**request.fields): an unknown field, a missing required one and a ValidationError
    are bad input."""
    unknown = sorted(set(request.fields) - set(accepted))
    if unknown:
        raise InputError(
            f"{request.where}: unknown field {unknown[0]!r}; {what} takes {', '.join(accepted)}"
        )
    required = [
        name
        for name, p in inspect.signature(method).parameters.items()
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    try:
        for name in required:
            if name not in request.fields:
                raise ValidationError("invalid_argument", f"the request has no {name!r}", name)
        return method(**request.fields)
    except ValidationError as e:
        raise InputError(f"{request.where}: {validation_message(e)}") from None


def _jsonable(value: Any) -> Any:
    """attrs/dataclass objects, numpy values and tuples as plain JSON values."""
    if attrs.has(type(value)):
        return {k: _jsonable(v) for k, v in attrs.asdict(value, recurse=False).items()}
    if hasattr(value, "__dataclass_fields__"):
        return {k: _jsonable(getattr(value, k)) for k in value.__dataclass_fields__}
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


# ---------------------------------------------------------------------------------------------
# serve, bench


def _run_cache(args: argparse.Namespace) -> int:
    """`tpuscore cache` (cli/cache.py); a malformed size setting is bad input."""
    try:
        return cache.run(args)
    except ValueError as e:
        raise InputError(str(e)) from None


def bench_script() -> Path | None:
    """benchmarks/bench.py of the source checkout tpuscore runs from, if it is one."""
    import tpuscore

    for root in (Path(tpuscore.__file__).resolve().parents[2], Path.cwd()):
        script = root / "benchmarks" / "bench.py"
        if script.is_file():
            return script
    return None


def _run_bench(args: argparse.Namespace) -> int:
    if args.model is not None:
        raise InputError("bench runs on the embedded default model; --model is not supported")
    script = args.script or bench_script()
    if script is None or not Path(script).is_file():
        raise EnvironmentProblem(
            "tpuscore bench runs benchmarks/bench.py, which ships with the source repository and "
            "not in the wheel: run it from a checkout, or pass --script path/to/bench.py"
        )
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        raise EnvironmentProblem(
            f"tpuscore bench times transformers as its baseline, and {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not installed: pip install torch "
            "transformers (a CPU build of torch is enough), or pip install -e '.[dev]' in a "
            "checkout"
        )
    command = [sys.executable, str(script)]
    if not args.full:
        command.append("--quick")
    if args.dtype:
        command += ["--dtype", args.dtype]
    command += [a for a in args.bench_args if a != "--"]
    print("running:", " ".join(command), file=sys.stderr)
    return subprocess.run(command, env=os.environ.copy(), check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
