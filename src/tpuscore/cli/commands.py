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

from tpuscore.api import validation
from tpuscore.api.errors import ValidationError
from tpuscore.api.requests import SCORE_ARGUMENTS, ScoreOptions
from tpuscore.cli import cache

USAGE_ERROR = 2  # bad input or arguments, as argparse exits
ENVIRONMENT_ERROR = 1  # what the command needs is not installed


class InputError(Exception):
    """Bad input from the user: reported as one line on stderr, exit status 2."""


class EnvironmentProblem(Exception):
    """Something the command needs is missing: one line on stderr, exit status 1."""


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
        choices=["float32", "bfloat16", "mixed"],
        help="default: float32 on CPU, bfloat16 on accelerators; mixed: bfloat16 matmul "
        "operands, float32 everywhere else (docs/api.md)",
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

    p = command("serve", _run_serve, "serve SGLang's /v1/score and the rerank API over HTTP")
    add = p.add_argument
    add("--host", default="127.0.0.1", help="default 127.0.0.1: this machine only")
    add("--port", type=int, default=8000)
    add("--served-model-name", help="the name /v1/models lists and responses carry")
    add(
        "--rerank-template",
        default="plain",
        help="prompt template of the rerank endpoints: plain or qwen3-reranker (default: plain)",
    )
    add(
        "--score-calibration",
        metavar="PATH",
        help="a tpuscore fit-calibration file: results also carry calibrated probabilities",
    )
    add("--max-body-bytes", type=int, default=16 << 20, help="largest request body (16 MiB)")
    add_request_limits(p)
    add(
        "--max-wait-ms",
        type=float,
        default=2.0,
        help="how long the batcher waits for more requests before it runs a batch",
    )
    add("--max-batch-tokens", type=int, help="the batcher's token budget per batch")
    add(
        "--max-pending",
        type=int,
        help="unfinished requests (queued or running) beyond which the server answers 503",
    )
    add(
        "--request-timeout",
        type=float,
        help="seconds a request may wait for its answer (default: no limit); past it the "
        "server answers 504 without scoring it. A client's X-Request-Timeout header may "
        "shorten it",
    )
    add(
        "--warmup",
        choices=("none", "all"),
        default="none",
        help="all: compile the scorer's whole shape set before serving (Scorer.warmup(all=True)), "
        "so no request within --warmup-limits compiles; none (default): compile on first use",
    )
    add(
        "--warmup-limits",
        help="the requests --warmup all covers, as query_tokens=N,item_tokens=N,labels=N (any of "
        "them; default the model's context length and 16 labels); smaller limits, fewer shapes",
    )
    add(
        "--allowed-hosts",
        help="comma-separated Host names the server answers, or '*' for any (default: the "
        "loopback names for a loopback --host, any otherwise)",
    )
    add(
        "--timeout-keep-alive",
        type=float,
        default=75.0,
        help="seconds an idle HTTP connection stays open (default 75: longer than the 60 s "
        "idle timeout of common load balancers, so none reuses a connection being closed)",
    )
    add(
        "--replicas",
        type=int,
        help="serve N replicas of the model on Ray Serve (the ray extra), behind one endpoint "
        "that routes requests by query so each replica's prefix cache keeps serving; default: "
        "one process, no Ray (docs/serving.md, Serving at scale)",
    )
    add(
        "--max-replicas",
        type=int,
        help="with --replicas N: autoscale between N and this many replicas on ongoing requests",
    )
    add(
        "--metrics-names",
        choices=("tpuscore", "vllm", "both"),
        default="tpuscore",
        help="GET /metrics' series: tpuscore's own (default), vLLM's names (vllm:...) for the "
        "dashboards and autoscalers that read them, or both",
    )

    p = command(
        "job",
        _run_job,
        "score a Parquet, JSON Lines or CSV table of pairs or requests into a table of scores, "
        "resuming after a crash (docs/jobs.md)",
    )
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
        "--on-error",
        choices=["skip", "fail"],
        default="skip",
        help="skip (default): write a bad row to OUTPUT.errors.jsonl and go on; fail: stop",
    )
    add("--shard-rows", type=int, default=4096, help="input rows per shard (default 4096)")
    add("--overwrite", action="store_true", help="start again instead of resuming OUTPUT")
    add("--progress", action="store_true", help="a progress bar even when stderr is no terminal")
    add("--quiet", action="store_true", help="no progress bar and no summary line")

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


def load_scorer(args: argparse.Namespace):
    """The Scorer for --model/--dtype/--backend/--mesh/--profile/--batch-invariant; a model or
    profile that cannot be loaded, or a backend the mode refuses, is bad input."""
    from tpuscore import Scorer, ValidationError
    from tpuscore.engine import compilation_cache

    mesh = parse_mesh(args.mesh)
    try:
        return Scorer.from_pretrained(
            args.model,
            dtype=args.dtype,
            backend=args.backend,
            mesh=mesh,
            profile=args.profile,
            compilation_cache_dir=compilation_cache.command_dir(args.no_compilation_cache),
            batch_invariant=args.batch_invariant,
            score_calibration=getattr(args, "score_calibration", None),
        )
    except ValidationError as e:
        flag = f"--backend {args.backend}"
        if e.param == "score_calibration":  # a calibration file refused for this model
            flag = "--score-calibration"
        raise InputError(f"{flag}: {e}") from None
    except Exception as e:  # noqa: BLE001 (any load failure goes back to the --model given)
        name = "the default model" if args.model is None else repr(args.model)
        raise InputError(f"cannot load {name}: {type(e).__name__}: {e}") from None


def parse_mesh(text: str | None):
    """A "DATAxMODEL" mesh over the first DATA*MODEL devices, or None."""
    if text is None:
        return None
    import jax
    import numpy as np
    from jax.sharding import Mesh

    try:
        data, model = (int(n) for n in text.lower().split("x"))
    except ValueError:
        raise InputError(f"--mesh must be DATAxMODEL, such as 2x4, got {text!r}") from None
    devices = jax.devices()
    if data < 1 or model < 1 or data * model > len(devices):
        raise InputError(f"--mesh {text} needs {data * model} devices; there are {len(devices)}")
    return Mesh(np.array(devices[: data * model]).reshape(data, model), ("data", "model"))


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
    """All requests validated first, then run together: requests sharing a query share work."""

    def prepare(**fields: Any):
        query, items, options = validation.request_arguments(fields)
        return scorer.engine.prepare(query, items, options)

    prepared = [_call(request, prepare, SCORE_ARGUMENTS, "Scorer.score") for request in requests]
    try:
        results = scorer.run(prepared)
    except ValidationError as e:  # a backend that cannot run these requests
        raise InputError(_validation_message(e)) from None
    return [
        {
            "scores": r.scores.tolist(),
            "logprobs": r.logprobs.tolist(),
            "backend": r.backend,
            "num_tokens": r.num_tokens,
            **({} if r.calibrated is None else {"calibrated": r.calibrated.tolist()}),
        }
        for r in results
    ]


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
        raise InputError(f"{request.where}: {_validation_message(e)}") from None


def _validation_message(e: Exception) -> str:
    return f"{e} [code {getattr(e, 'code', None)}, param {getattr(e, 'param', None)}]"


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


def _run_serve(args: argparse.Namespace) -> int:
    try:
        from tpuscore.serving import app as server
    except ImportError as e:
        raise EnvironmentProblem(
            f"tpuscore serve needs the server extra ({e.name} is missing): "
            "pip install -e '.[server]'"
        ) from None
    if not 0 <= args.port <= 65535:
        raise InputError(f"--port {args.port} is not a port number (0..65535)")
    if not args.timeout_keep_alive > 0:
        raise InputError(f"--timeout-keep-alive {args.timeout_keep_alive} must be > 0 seconds")
    check_port_free(args.host, args.port)  # before the model loads: fail in a second, not 15
    if args.replicas is not None or args.max_replicas is not None:
        return _run_serve_replicas(args, server)
    limits = parse_limits(args.warmup_limits)
    request_bounds = request_limits(args)  # before the model loads, as the port check
    scorer = load_scorer(args)
    if args.warmup == "all":
        warm_shape_set(scorer, limits)
    batcher_options = {"max_wait_ms": args.max_wait_ms, "max_batch_tokens": args.max_batch_tokens}
    if args.max_pending is not None:
        batcher_options["max_pending"] = args.max_pending
    if args.request_timeout is not None:
        batcher_options["request_timeout_s"] = args.request_timeout
    allowed_hosts = None  # the loopback names and the address itself on a loopback address
    if args.allowed_hosts is not None:
        allowed_hosts = [h.strip() for h in args.allowed_hosts.split(",") if h.strip()]
    try:
        app = server.create_app(
            scorer,
            model_name=args.served_model_name or server.model_name(args.model),
            rerank_template=args.rerank_template,
            max_body_bytes=args.max_body_bytes,
            limits=request_bounds,
            batcher_options=batcher_options,
            allowed_hosts=allowed_hosts,
            metrics_names=args.metrics_names,
        )
    except ValueError as e:  # a bad flag value: template name, limits
        raise InputError(str(e)) from None
    print(
        f"tpuscore: serving {app.state.service.model_name} on http://{args.host}:{args.port} "
        "(POST /v1/score /v1/rerank /v2/rerank, GET /health /v1/models /metrics)",
        file=sys.stderr,
    )
    server.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_keep_alive=args.timeout_keep_alive,
    )
    return 0


def _run_serve_replicas(args: argparse.Namespace, server) -> int:
    """`tpuscore serve --replicas N`: the same app on N Ray Serve replicas behind a gateway
    (`tpuscore.integrations.ray_serve`), on the Ray cluster at RAY_ADDRESS or a local one."""
    if args.replicas is None or args.replicas < 1:
        raise InputError(f"--replicas must be an int >= 1, got {args.replicas}")
    if args.max_replicas is not None and args.max_replicas < args.replicas:
        raise InputError(f"--max-replicas {args.max_replicas} is below --replicas {args.replicas}")
    for flag in ("mesh", "warmup_limits"):
        if getattr(args, flag) is not None:
            raise InputError(f"--{flag.replace('_', '-')} is not supported with --replicas")
    if args.warmup != "none":
        raise InputError("--warmup all is not supported with --replicas")
    try:
        import ray
        from ray import serve

        from tpuscore.integrations import ray_serve
    except ImportError as e:
        raise EnvironmentProblem(
            f"--replicas needs the ray extra ({e.name} is missing): pip install -e '.[ray]'"
        ) from None
    from tpuscore.engine import compilation_cache

    batcher_options = {"max_wait_ms": args.max_wait_ms, "max_batch_tokens": args.max_batch_tokens}
    if args.max_pending is not None:
        batcher_options["max_pending"] = args.max_pending
    if args.request_timeout is not None:
        batcher_options["request_timeout_s"] = args.request_timeout
    if args.allowed_hosts is None:  # each replica's app checks the Host the gateway passes on
        allowed_hosts = server.guards.default_allowed_hosts(args.host)
    else:
        allowed_hosts = [h.strip() for h in args.allowed_hosts.split(",") if h.strip()]
    cache = compilation_cache.command_dir(args.no_compilation_cache)  # each replica's too
    app = ray_serve.build_app(
        args.model,
        num_replicas=args.replicas,
        max_replicas=args.max_replicas,
        scorer_options={
            "dtype": args.dtype,
            "backend": args.backend,
            "profile": args.profile,
            "batch_invariant": args.batch_invariant,
            "compilation_cache_dir": cache,
        },
        app_options={
            "model_name": args.served_model_name or server.model_name(args.model),
            "rerank_template": args.rerank_template,
            "max_body_bytes": args.max_body_bytes,
            "max_items": args.max_items,
            "batcher_options": batcher_options,
            "metrics_names": args.metrics_names,
            "allowed_hosts": allowed_hosts,
        },
    )
    ray.init(address=os.environ.get("RAY_ADDRESS"))
    serve.start(
        http_options={
            "host": args.host,
            "port": args.port,
            "keep_alive_timeout_s": int(args.timeout_keep_alive),
        }
    )
    print(
        f"tpuscore: serving {args.replicas} replicas on http://{args.host}:{args.port} "
        "(Ray Serve; requests routed by query)",
        file=sys.stderr,
    )
    serve.run(app, name="tpuscore", route_prefix="/", blocking=True)
    return 0


def add_request_limits(parser: argparse.ArgumentParser) -> None:
    """A flag per `RequestLimits` field (--max-items, --max-labels, ...), its default and help
    from the declaration."""
    from tpuscore.api.requests import RequestLimits, attribute_docs

    docs = attribute_docs(RequestLimits)
    for field in attrs.fields(RequestLimits):
        parser.add_argument(
            "--" + field.name.replace("_", "-"),
            type=int,
            default=field.default,
            help=f"{docs[field.name]} (default {field.default})",
        )


def request_limits(args: argparse.Namespace):
    """The `RequestLimits` the flags give; InputError for a value below 1."""
    from tpuscore.api.requests import RequestLimits

    try:
        return RequestLimits(**{name: getattr(args, name) for name in RequestLimits.names()})
    except ValueError as e:
        raise InputError(f"--{str(e).replace('_', '-')}") from None


def parse_limits(text: str | None) -> dict[str, int]:
    """--warmup-limits "query_tokens=512,labels=2" as a mapping; InputError if malformed."""
    limits = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        name, _, value = part.partition("=")
        if not value.strip().isdigit():
            raise InputError(f"--warmup-limits: {part!r} is not NAME=INT")
        limits[name.strip()] = int(value)
    return limits


def warm_shape_set(scorer, limits: dict[str, int]) -> None:
    """Compile the scorer's shape set within `limits`, saying how many and how long."""
    from tpuscore import ValidationError

    try:
        count = len(scorer.shapes(limits))
        print(f"tpuscore: compiling {count} step shapes (--warmup all)", file=sys.stderr)
        warmed = scorer.warmup(all=True, limits=limits)
    except ValidationError as e:
        raise InputError(f"--warmup-limits: {e}") from None
    seconds = sum(w.seconds for w in warmed)
    print(f"tpuscore: compiled {count} step shapes in {seconds:.1f} s", file=sys.stderr)


def check_port_free(host: str, port: int) -> None:
    """EnvironmentProblem if `port` on `host` cannot be bound (taken, or not this machine's)."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind((host, port))
        except OSError as e:
            raise EnvironmentProblem(
                f"cannot serve on {host}:{port}: {e.strerror or e}; choose another --port "
                "(or stop what holds it)"
            ) from None


def _run_job(args: argparse.Namespace) -> int:
    """`tpuscore job`: checks the table and settings, loads the model, runs `score_table`."""
    try:
        from tpuscore import ValidationError, jobs
    except ImportError as e:
        raise EnvironmentProblem(
            f"tpuscore job needs the jobs extra ({e.name} is missing): pip install -e '.[jobs]'"
        ) from None
    from tpuscore.engine import compilation_cache

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
    }
    backend = None if args.backend == "auto" else args.backend
    try:
        jobs.Spec(**settings).layout(jobs.open_table(args.input).schema)  # before the model loads
        try:
            scorer = jobs.load_scorer(
                args.model,
                dtype=args.dtype,
                mesh=parse_mesh(args.mesh),
                profile=args.profile,
                compilation_cache_dir=compilation_cache.command_dir(args.no_compilation_cache),
                batch_invariant=args.batch_invariant,
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
            model=args.model,
            backend=backend,
            on_error=args.on_error,
            shard_rows=args.shard_rows,
            overwrite=args.overwrite,
            show_progress=not args.quiet and (args.progress or sys.stderr.isatty()),
            **settings,
        )
    except ValidationError as e:
        raise InputError(_validation_message(e)) from None
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
