"""What every `tpuscore` command shares: its two kinds of failure and loading the scorer its
flags name."""

from __future__ import annotations

import argparse

USAGE_ERROR = 2  # bad input or arguments, as argparse exits
ENVIRONMENT_ERROR = 1  # what the command needs is not installed


class InputError(Exception):
    """Bad input from the user: reported as one line on stderr, exit status 2."""


class EnvironmentProblem(Exception):
    """Something the command needs is missing: one line on stderr, exit status 1."""


def load_scorer(args: argparse.Namespace):
    """The Scorer for --model/--dtype/--backend/--mesh/--profile/--batch-invariant; a model or
    profile that cannot be loaded, or a backend the mode refuses, is bad input."""
    from tpuscore import Scorer, ValidationError
    from tpuscore.engine import compilation_cache

    mesh = parse_mesh(args.mesh)
    cache_dir = compilation_cache.command_dir(args.no_compilation_cache)
    if cache_dir:
        try:  # the variable's own message, not "cannot load the model"
            compilation_cache.max_size()
        except ValueError as e:
            raise InputError(str(e)) from None
    # The flags' own errors before loading, not as "cannot load MODEL".
    adapters, limits = parse_adapters(getattr(args, "adapter", None)), scorer_limits(args)
    try:
        return Scorer.from_pretrained(
            args.model,
            dtype=args.dtype,
            backend=args.backend,
            mesh=mesh,
            profile=args.profile,
            compilation_cache_dir=cache_dir,
            batch_invariant=args.batch_invariant,
            score_calibration=getattr(args, "score_calibration", None),
            adapters=adapters,
            limits=limits,
        )
    except ValidationError as e:
        flag = f"--backend {args.backend}"
        if e.param == "score_calibration":  # a calibration file refused for this model
            flag = "--score-calibration"
        elif e.param == "profile":  # a profile file that is not one
            flag = "--profile"
        elif e.loc[:1] == ("adapters",):  # an adapter that does not load or fit the model
            flag = f"--adapter {e.loc[1]}" if len(e.loc) > 1 else "--adapter"
        raise InputError(f"{flag}: {e}") from None
    except Exception as e:  # noqa: BLE001 (any load failure goes back to the --model given)
        name = "the default model" if args.model is None else repr(args.model)
        raise InputError(f"cannot load {name}: {type(e).__name__}: {e}") from None


def scorer_limits(args: argparse.Namespace):
    """The scorer's request bounds under a server's --max-items, --max-labels, ... flags: the
    library's, raised to the flags where those are larger (the server checks its own first);
    None (the library's) for a command without them."""
    from tpuscore.api.requests import LIBRARY_LIMITS, RequestLimits

    if not all(hasattr(args, name) for name in RequestLimits.names()):
        return None
    try:
        flags = RequestLimits(**{name: getattr(args, name) for name in RequestLimits.names()})
    except ValueError as e:
        raise InputError(f"--{str(e).replace('_', '-')}") from None
    return LIBRARY_LIMITS.widened(flags)


def parse_adapters(values: list[str] | None) -> dict[str, str] | None:
    """--adapter NAME=PATH flags as `Scorer(adapters=)` takes them; a malformed or repeated
    name is bad input."""
    if not values:
        return None
    adapters: dict[str, str] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise InputError(f"--adapter {value!r}: expected NAME=PATH")
        if name in adapters:
            raise InputError(f"--adapter {name!r} is given twice")
        adapters[name] = path
    return adapters


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


def validation_message(e: Exception) -> str:
    """A `ValidationError` as one line, its code and parameter named."""
    return f"{e} [code {getattr(e, 'code', None)}, param {getattr(e, 'param', None)}]"
