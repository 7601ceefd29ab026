"""Fit a device profile on this machine: `python -m tpuscore.cli.calibrate --out my-device.json`.

Times every backend that runs compiled here on a grid of request geometries (query tokens, items,
item tokens) with the default model (or --model), each on a cold prefix cache, warm executables,
the median of three runs (one when a run takes over 3 s). Half the grid (every other point) fits
the profile's constants by non-negative least squares on relative error: per call, seconds =
steps * step_seconds + flops / matmul rate + bytes / bandwidth + scores * score_seconds, the work
counted by the backends' own `work` (`selection.py`). The other half checks it: at each held-out
point, the backend auto picks with the fitted profile must be within 25% of the fastest measured.

A backend is first timed on 1, 4, 16, ... of a point's items: once that already takes longer
than another backend's whole run, it is not timed on the whole point (its time there is at least
that: `>=` in the table), and that point is not fitted on it. With a Pallas backend that runs
interpreted here, one small point times it to fit the interpret penalty.

Prints the machine, the command and the table (markdown), writes the profile, and exits 1 if the
check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import attrs
import jax
import numpy as np
from scipy.optimize import nnls

from tpuscore.backends import registry
from tpuscore.engine import planning, selection
from tpuscore.engine.profiles import DeviceProfile
from tpuscore.scorer import Scorer

# (query tokens, items, item tokens): spans queries of 0-4000 tokens, 1-2000 items of 1-200 tokens.
GRID = (
    (0, 64, 8),
    (16, 2000, 1),
    (32, 200, 20),
    (64, 10, 200),
    (150, 40, 7),
    (256, 1, 64),
    (400, 100, 16),
    (700, 24, 33),
    (1000, 8, 100),
    (1500, 300, 4),
    (2000, 40, 20),
    (4000, 2, 10),
    (100, 1000, 20),
    (30, 500, 64),
)
INTERPRET_POINT = (16, 4, 8)
TOLERANCE = 1.25
LABELS = [5, 6]


@attrs.frozen
class Timing:
    """A backend's seconds at a point; `lower_bound`: only its one-item run was timed."""

    seconds: float
    lower_bound: bool = False


def batches_for(scorer: Scorer, geometry: tuple[int, int, int], seed: int = 0):
    q, n, length = geometry
    rng = np.random.default_rng(seed)
    vocab = scorer.config.vocab_size
    request = scorer.prepare(
        rng.integers(100, vocab, q).tolist(),
        rng.integers(100, vocab, (n, length)).tolist(),
        LABELS,
    )
    return [g.batch for g in planning.group([request])]


def time_backend(scorer: Scorer, name: str, batches) -> float:
    """Median seconds of a cold-cache call with warm executables."""

    def once() -> float:
        backend = scorer.backends.fresh().get(name)  # a cold prefix cache, as a new query meets
        start = time.perf_counter()
        registry.score_groups(backend, batches)
        return time.perf_counter() - start

    once()  # compiles
    first = once()
    return first if first > 3 else statistics.median([first, once(), once()])


def features(scorer: Scorer, name: str, batches) -> np.ndarray:
    """(steps, flops, bytes, scores) of a call: what the profile's constants multiply."""
    steps = scorer.backends.fresh().get(name).work(batches)
    return np.array(
        [len(steps), *(sum(getattr(s, f) for s in steps) for f in ("flops", "bytes", "scores"))]
    )


def measure(scorer: Scorer, names, geometry) -> dict[str, Timing]:
    """Each backend's seconds at this point. After the first, a backend is timed on 1, 4, 16,
    ... of the items first: once that already takes longer than the fastest so far, its time on
    all of them is at least that, and it is not timed further."""
    q, n, length = geometry
    timings: dict[str, Timing] = {}
    for name in names:
        best = min((t.seconds for t in timings.values() if not t.lower_bound), default=None)
        count = 1
        while best is not None and count < n:
            seconds = time_backend(scorer, name, batches_for(scorer, (q, count, length)))
            if seconds > best:
                timings[name] = Timing(seconds, lower_bound=True)
                break
            count *= 4
        else:
            timings[name] = Timing(time_backend(scorer, name, batches_for(scorer, geometry)))
        bound = f">= {timings[name].seconds:.3f} s ({count} items)"
        shown = bound if timings[name].lower_bound else f"{timings[name].seconds:.3f} s"
        print(f"  {geometry} {name}: {shown}", flush=True)
    return timings


def fit(rows: list[tuple[np.ndarray, float]]) -> np.ndarray:
    """Non-negative (step, per-flop, per-byte, per-score) seconds minimizing relative error."""
    X = np.array([f / t for f, t in rows])
    scale = X.max(axis=0)
    scale[scale == 0] = 1
    coef, _ = nnls(X / scale, np.ones(len(rows)))
    return coef / scale


def profile_from(coef: np.ndarray, dtype: str, penalty: float, command: str) -> DeviceProfile:
    step, per_flop, per_byte, per_score = (float(c) for c in coef)
    return DeviceProfile(
        name=jax.devices()[0].device_kind,
        device_kinds=(jax.devices()[0].device_kind,),
        matmul_flops={dtype: 1 / per_flop if per_flop else 1e30},
        memory_bandwidth=1 / per_byte if per_byte else 1e30,
        step_seconds=step,
        score_seconds=per_score,
        interpret_penalty=penalty,
        measured=True,
        source=f"{command} on {platform.node()} ({os.cpu_count()} CPUs, "
        f"{jax.devices()[0].platform}), {time.strftime('%Y-%m-%d')}",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tpuscore.cli.calibrate", description=__doc__)
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--out", default="tpuscore-profile.json", help="the profile to write")
    parser.add_argument("--measurements", help="also write every timing and estimate as JSON")
    args = parser.parse_args(argv)
    command = "python -m tpuscore.cli.calibrate " + " ".join(argv or sys.argv[1:])
    print(f"# {command}\n# {platform.platform()}, {os.cpu_count()} CPUs, jax {jax.__version__}, "
          f"{jax.devices()[0].device_kind}", flush=True)  # fmt: skip
    scorer = Scorer.from_pretrained(args.model, dtype=args.dtype)
    platform_name = jax.default_backend()
    compiled = [
        n for n in registry.candidates()
        if registry.registration(n).capabilities.compiled(platform_name)
    ]  # fmt: skip
    interpreted = [n for n in registry.candidates() if n not in compiled]

    measured = {geometry: measure(scorer, compiled, geometry) for geometry in GRID}
    fit_points, check_points = GRID[::2], GRID[1::2]
    rows = [
        (features(scorer, name, batches_for(scorer, g)), t.seconds)
        for g in fit_points
        for name, t in measured[g].items()
        if not t.lower_bound
    ]
    coef = fit(rows)
    penalty = 1.0
    for name in interpreted[:1]:
        batches = batches_for(scorer, INTERPRET_POINT)
        seconds = time_backend(scorer, name, batches)
        penalty = seconds / float(features(scorer, name, batches) @ coef)
        print(f"  {INTERPRET_POINT} {name} (interpreted): {seconds:.3f} s", flush=True)
    profile = profile_from(coef, scorer.dtype.name, penalty, command)
    profile.save(args.out)

    model = selection.CostModel(profile)
    print(f"\n{'| query, items, item tokens | split | ' + ' | '.join(compiled)} | auto | "
          "auto / fastest |")  # fmt: skip
    print("|---" * (len(compiled) + 4) + "|")
    failures, records = 0, []
    for g in GRID:
        batches = batches_for(scorer, g)
        plan = model.plan(batches, scorer.backends.fresh(), eligible_only=True)
        times = measured[g]
        fastest = min(t.seconds for t in times.values() if not t.lower_bound)
        ratio = times[plan.pick].seconds / fastest if not times[plan.pick].lower_bound else None
        held_out = g in check_points
        ok = ratio is not None and ratio <= TOLERANCE
        failures += held_out and not ok
        cells = [
            f"{'>= ' if t.lower_bound else ''}{t.seconds:.3g} (est. {plan[n].seconds:.3g})"
            for n, t in times.items()
        ]
        shown = f"{ratio:.2f}" if ratio is not None else "slower than a measured backend"
        print(f"| {g} | {'check' if held_out else 'fit'} | {' | '.join(cells)} | {plan.pick} | "
              f"{shown}{'' if ok or not held_out else ' FAIL'} |")  # fmt: skip
        records.append(
            {
                "geometry": g, "held_out": held_out, "pick": plan.pick, "ratio": ratio,
                "measured": {n: attrs.asdict(t) for n, t in times.items()},
                "estimated": {e.backend: e.seconds for e in plan.estimates},
            }
        )  # fmt: skip
    print(f"\nprofile: {json.dumps(attrs.asdict(profile))}")
    verdict = "passes" if not failures else f"fails at {failures} point(s)"
    print(f"held-out check (auto within {TOLERANCE - 1:.0%} of the fastest): {verdict}")
    if args.measurements:
        with open(args.measurements, "w") as f:
            json.dump({"command": command, "profile": attrs.asdict(profile), "points": records}, f,
                      indent=1)  # fmt: skip
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
