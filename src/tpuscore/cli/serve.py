"""`tpuscore serve`: its flags, and the server in one process or as Ray Serve replicas."""

from __future__ import annotations

import argparse
import os
import sys

import attrs

from tpuscore.cli.common import (
    EnvironmentProblem,
    InputError,
    load_scorer,
    parse_adapters,
    scorer_limits,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """serve's own flags (the shared ones come from the command's parent parser)."""
    add = p.add_argument
    add("--host", default="127.0.0.1", help="default 127.0.0.1: this machine only")
    add("--port", type=int, default=8000)
    add("--served-model-name", help="the name /v1/models lists and responses carry")
    add(
        "--adapter",
        action="append",
        metavar="NAME=PATH",
        help="a PEFT LoRA adapter directory served as model NAME (repeatable): a request's "
        '"model": NAME scores with it, /v1/models lists it (docs/adapters.md)',
    )
    add(
        "--rerank-template",
        default="plain",
        help="prompt template of the rerank endpoints: plain or qwen3-reranker (default: plain); "
        "none: no rerank endpoints (they answer 404 rerank_not_configured), for a model whose "
        "tokenizer does not make the templates' labels single tokens: /v1/score only",
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
        "--max-queued-tokens",
        type=int,
        help="tokens queued (estimated from text bytes until tokenized) beyond which the server "
        "answers 503 (default 8,388,608; a request alone in the queue always gets in)",
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


def run(args: argparse.Namespace) -> int:
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
        return run_replicas(args, server)
    limits = parse_limits(args.warmup_limits)
    request_bounds = request_limits(args)  # before the model loads, as the port check
    options = batcher_options(args)
    scorer = load_scorer(args)
    if args.warmup == "all":
        warm_shape_set(scorer, limits)
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
            batcher_options=options,
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


def run_replicas(args: argparse.Namespace, server) -> int:
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

    options = batcher_options(args)
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
            "limits": scorer_limits(args),
            "score_calibration": args.score_calibration,
            **({"adapters": parse_adapters(args.adapter)} if args.adapter else {}),
        },
        app_options={
            "model_name": args.served_model_name or server.model_name(args.model),
            "rerank_template": args.rerank_template,
            "max_body_bytes": args.max_body_bytes,
            "limits": request_limits(args),
            "batcher_options": options,
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
        f"tpuscore: starting {args.replicas} replicas on http://{args.host}:{args.port} "
        "(Ray Serve; requests routed by query); each serves once its model is loaded",
        file=sys.stderr,
    )
    try:
        serve.run(app, name=RAY_APP, route_prefix="/", blocking=True)
    except RuntimeError as e:  # Serve gave up on a replica (it retries a failing constructor)
        # A model that cannot load fails as a one-process server's would: one line, status 2.
        raise InputError(f"the replicas cannot start: {replica_error(serve) or e}") from None
    return 0


RAY_APP = "tpuscore"  # the Serve application `--replicas` deploys


def replica_error(serve) -> str | None:
    """The last line of the error a replica failed to start with (Serve keeps the whole
    traceback in the deployment's status message), or None where Serve recorded none."""
    try:
        message = serve.status().applications[RAY_APP].deployments["Replica"].message
    except Exception:  # noqa: BLE001 (no status to read: the caller reports Serve's own error)
        return None
    lines = [line.strip() for line in (message or "").splitlines() if line.strip()]
    return lines[-1] if lines else None


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


# The Batcher's options the serve flags set, and the flag of each.
BATCHER_FLAGS = {
    "max_wait_ms": "--max-wait-ms",
    "max_batch_tokens": "--max-batch-tokens",
    "max_pending": "--max-pending",
    "max_queued_tokens": "--max-queued-tokens",
    "request_timeout_s": "--request-timeout",
}


def batcher_options(args: argparse.Namespace) -> dict[str, object]:
    """The Batcher's options the flags give, checked (and --max-body-bytes) before the model
    loads, as the port check; InputError names the flag of a bad value."""
    if args.max_body_bytes < 1:
        raise InputError(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    values = {
        "max_wait_ms": args.max_wait_ms,
        "max_batch_tokens": args.max_batch_tokens,
        "max_pending": args.max_pending,
        "max_queued_tokens": args.max_queued_tokens,
        "request_timeout_s": args.request_timeout,
    }
    options = {name: value for name, value in values.items() if value is not None}
    from tpuscore.serving.admission import OptionError, check_options

    try:
        check_options(**options)
    except OptionError as e:
        raise InputError(f"{BATCHER_FLAGS[e.option]} {e.message}") from None
    return options


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
