"""Fit a device profile on this machine: `python -m tpuscore.cli.calibrate --out my-device.json`.

Times every backend that runs compiled here on a grid of request geometries (query tokens, items,
item tokens) with the default model (or --model). Every call gets a fresh random query (so a
prefix-cache hit that auto could not foresee never times prefill_extend), with warm executables;
the backends run in interleaved rounds (A, B, C, A, B, C, ...) and each point takes the median of
three calls (one when the fastest call takes over 3 s). Half the grid (every other point) fits
the profile's constants by non-negative least squares on relative error: per call, seconds =
steps * step_seconds + flops / matmul rate + bytes / bandwidth + scores * score_seconds, the work
counted by the backends' own `work` (`selection.py`). The other half checks it: at each held-out
point, the backend auto picks with the fitted profile must be within 25% of the fastest measured.

A backend is first timed on 1, 4, 16, ... of a point's items: once that already takes longer
than another backend's whole run, it is not timed on the whole point (its time there is at least
that: `>=` in the table), and that point is not fitted on it. With a Pallas backend that runs
interpreted here, one small point times it to fit the interpret penalty.

Prints the machine, its load, the command and the table (markdown), writes the profile, and exits
1 if the check fails. `--refit` redoes the fit and the check on an earlier run's timings.
`--into PROFILE` adds this dtype's matmul rate to an existing profile: only the rate is fitted,
the profile's per-step, per-byte and per-score constants kept (they do not depend on the dtype
the matmuls multiply in), and the check runs on the profile so extended.
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

from tpuscore.api.errors import ValidationError
from tpuscore.backends import registry
from tpuscore.engine import planning, selection
from tpuscore.engine.profiles import DeviceProfile
from tpuscore.scorer import Scorer

# (query tokens, items, item tokens): queries of 0-4000 tokens, 1-1000 items of 1-200 tokens, every
# other point held out. Points 15-20 fill in long items against short queries, few items, where
# packed_dense and prefill_extend run close ((60, 12, 90), auto's miss in issue 26, is held out);
# the last four are small requests, whose calls are mostly per-step cost.
GRID = (
    (0, 64, 8),
    (16, 1000, 1),
    (32, 200, 20),
    (64, 10, 200),
    (150, 40, 7),
    (256, 1, 64),
    (400, 100, 16),
    (700, 24, 33),
    (1000, 8, 100),
    (1500, 100, 4),
    (2000, 40, 20),
    (4000, 2, 10),
    (100, 300, 20),
    (30, 150, 64),
    (20, 4, 120),
    (60, 12, 90),
    (100, 6, 150),
    (40, 3, 160),
    (10, 24, 60),
    (120, 16, 100),
    (10, 1, 5),
    (50, 2, 10),
    (300, 10, 10),
    (20, 50, 5),
)
INTERPRET_POINT = (16, 4, 8)
TOLERANCE = 1.25
ROUNDS = 3  # samples per backend and point, in interleaved rounds
LONG_CALL = 3.0  # seconds: a point whose fastest call takes longer is timed once per backend
LABELS = [5, 6]


@attrs.frozen
class Timing:
    """A backend's median seconds at a point over `samples`; `lower_bound`: only a run on some
    of its items was timed, and that was already slower than another backend's whole call."""

    seconds: float
    lower_bound: bool = False
    samples: tuple[float, ...] = attrs.field(default=(), converter=tuple)


class Requests:
    """Fresh random requests: every call gets a query and items never seen before, so
    prefill_extend prefills each query as a new user's query makes it (a prefix-cache hit auto
    could not foresee never times it)."""

    def __init__(self, scorer: Scorer, seed: int = 0):
        self.scorer = scorer
        self.rng = np.random.default_rng(seed)

    def batches(self, geometry: tuple[int, int, int]):
        return batches_for(self.scorer, geometry, self.rng)


def batches_for(scorer: Scorer, geometry: tuple[int, int, int], seed=0):
    """The grouped batches of one request of this geometry, random tokens from `seed` (an int
    or a numpy Generator)."""
    q, n, length = geometry
    rng = np.random.default_rng(seed)
    vocab = scorer.config.vocab_size
    request = scorer.prepare(
        rng.integers(100, vocab, q).tolist(),
        rng.integers(100, vocab, (n, length)).tolist(),
        LABELS,
    )
    return [g.batch for g in planning.group([request])]


def call_seconds(scorer: Scorer, name: str, batches) -> float:
    """Seconds of one call on the scorer's own backend instance (its prefix cache as the calls
    before left it; fresh queries never hit it)."""
    backend = scorer.backends.get(name)
    start = time.perf_counter()
    registry.score_groups(backend, batches)
    return time.perf_counter() - start


def first_call(scorer: Scorer, requests: Requests, name: str, geometry) -> float:
    """Seconds of a call with warm executables: a first call compiles, a second is timed."""
    call_seconds(scorer, name, requests.batches(geometry))
    return call_seconds(scorer, name, requests.batches(geometry))


def features(scorer: Scorer, name: str, batches) -> np.ndarray:
    """(steps, flops, bytes, scores) of a call on a cold prefix cache: what the profile's
    constants multiply."""
    steps = scorer.backends.fresh().get(name).work(batches)
    return np.array(
        [len(steps), *(sum(getattr(s, f) for s in steps) for f in ("flops", "bytes", "scores"))]
    )


def measure(scorer: Scorer, requests: Requests, names, geometry) -> dict[str, Timing]:
    """Each backend's median seconds at this point, every call on a fresh query.

    Each backend is compiled and timed once, in turn; after the first, a backend is timed on 1,
    4, 16, ... of the items first: once that already takes longer than the fastest so far, its
    time on all of them is at least that, and it is not timed further. The backends timed in
    full then run `ROUNDS - 1` more interleaved rounds (A, B, C, A, B, C), unless the fastest
    call already took over `LONG_CALL` seconds (one sample each: the point is decided)."""
    q, n, length = geometry
    timings: dict[str, Timing] = {}
    for name in names:
        best = min((t.seconds for t in timings.values() if not t.lower_bound), default=None)
        count = 1
        while best is not None and count < n:
            seconds = first_call(scorer, requests, name, (q, count, length))
            if seconds > best:
                timings[name] = Timing(seconds, lower_bound=True, samples=[seconds])
                print(f"  {geometry} {name}: >= {seconds:.3f} s ({count} items)", flush=True)
                break
            count *= 4
        else:
            seconds = first_call(scorer, requests, name, geometry)
            timings[name] = Timing(seconds, samples=[seconds])
    full = [name for name, t in timings.items() if not t.lower_bound]
    samples = {name: list(timings[name].samples) for name in full}
    rounds = ROUNDS - 1 if min(s[0] for s in samples.values()) <= LONG_CALL else 0
    for _ in range(rounds):
        for name in full:
            samples[name].append(call_seconds(scorer, name, requests.batches(geometry)))
    for name in full:
        timings[name] = Timing(statistics.median(samples[name]), samples=samples[name])
        shown = ", ".join(f"{s:.3f}" for s in samples[name])
        print(f"  {geometry} {name}: {timings[name].seconds:.3f} s ({shown})", flush=True)
    return timings


def time_grid(scorer: Scorer, requests: Requests, names, budget_s: float | None = None) -> dict:
    """`measure` at each point of GRID in order, starting none once `budget_s` has passed (the
    first always runs)."""
    deadline = time.monotonic() + (budget_s if budget_s is not None else float("inf"))
    measured = {}
    for g in GRID:
        measured[g] = measure(scorer, requests, names, g)
        if time.monotonic() > deadline and len(measured) < len(GRID):
            print(f"# --budget-s {budget_s}: stopped after {len(measured)} points", flush=True)
            break
    return measured


def fit(rows: list[tuple[np.ndarray, float]]) -> np.ndarray:
    """Non-negative (step, per-flop, per-byte, per-score) seconds minimizing relative error."""
    X = np.array([f / t for f, t in rows])
    scale = X.max(axis=0)
    scale[scale == 0] = 1
    coef, _ = nnls(X / scale, np.ones(len(rows)))
    return coef / scale


def fit_rate(rows: list[tuple[np.ndarray, float]], base: DeviceProfile) -> np.ndarray:
    """`base`'s (step, -, per-byte, per-score) seconds with the per-flop seconds minimizing
    relative error on what they leave of each time (least squares, closed form)."""
    coef = np.array([base.step_seconds, 0.0, 1 / base.memory_bandwidth, base.score_seconds])
    flops = np.array([f[1] / t for f, t in rows])
    rest = np.array([(t - f @ coef) / t for f, t in rows])
    coef[1] = max(float(flops @ rest / (flops @ flops)), 1e-30)
    return coef


def extended(base: DeviceProfile, per_flop: float, dtype: str, command: str) -> DeviceProfile:
    """`base` with `dtype`'s matmul rate added (or replaced), its source saying how."""
    return attrs.evolve(
        base,
        matmul_flops={**base.matmul_flops, dtype: 1 / per_flop},
        source=f"{base.source}; {dtype} rate: {command}, {time.strftime('%Y-%m-%d')}",
    )


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
    parser.add_argument(
        "--into",
        metavar="PROFILE",
        help="fit only this dtype's matmul rate and add it to PROFILE (its other constants kept), "
        "writing PROFILE: e.g. --dtype mixed --into cpu.json prices bfloat16 matmuls",
    )
    parser.add_argument(
        "--refit",
        metavar="MEASUREMENTS",
        help="time nothing: fit and check on the timings of an earlier run's --measurements file "
        "(its grid and split), e.g. after a change to how `work` prices steps",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        help="time no new point after this many seconds: fit and check on the points timed "
        "(the grid alternates fitted and held-out points, so a prefix keeps both)",
    )
    args = parser.parse_args(argv)
    try:  # before the timing, not after
        base = DeviceProfile.load(args.into) if args.into else None
    except ValidationError as e:
        parser.error(f"--into: {e.message}")
    command = "python -m tpuscore.cli.calibrate " + " ".join(argv or sys.argv[1:])
    load = {"before": _load()}
    print(f"# {command}\n# {platform.platform()}, {os.cpu_count()} CPUs, jax {jax.__version__}, "
          f"{jax.devices()[0].device_kind}, load average {_load()}", flush=True)  # fmt: skip
    scorer = Scorer.from_pretrained(args.model, dtype=args.dtype)
    platform_name = jax.default_backend()
    compiled = [
        n for n in registry.candidates()
        if registry.registration(n).capabilities.compiled(platform_name)
    ]  # fmt: skip
    interpreted = [n for n in registry.candidates() if n not in compiled]

    if args.refit:
        with open(args.refit) as f:
            earlier = json.load(f)
        points = [tuple(p["geometry"]) for p in earlier["points"]]
        check_points = {tuple(p["geometry"]) for p in earlier["points"] if p["held_out"]}
        measured = {
            tuple(p["geometry"]): {n: Timing(**t) for n, t in p["measured"].items()}
            for p in earlier["points"]
        }
        interpret = earlier.get("interpret")
        load = earlier.get("load", {})
        command += f" (timings of {earlier['command']})"
    else:
        requests = Requests(scorer)
        measured = time_grid(scorer, requests, compiled, args.budget_s)
        points, check_points = list(measured), set(GRID[1::2]) & set(measured)
        interpret = None
        for name in interpreted[:1]:
            seconds = first_call(scorer, requests, name, INTERPRET_POINT)
            interpret = {"backend": name, "geometry": INTERPRET_POINT, "seconds": seconds}
            print(f"  {INTERPRET_POINT} {name} (interpreted): {seconds:.3f} s", flush=True)
        load["after"] = _load()
    rows = [
        (features(scorer, name, batches_for(scorer, g)), t.seconds)
        for g in points
        if g not in check_points
        for name, t in measured[g].items()
        if not t.lower_bound
    ]
    dtype = jax.numpy.dtype(scorer.engine.model.matmul_dtype).name
    if base is not None:
        coef = fit_rate(rows, base)
        profile = extended(base, coef[1], dtype, command)
        profile.save(args.into)
    else:
        coef = fit(rows)
        penalty = 1.0
        if interpret:
            batches = batches_for(scorer, tuple(interpret["geometry"]))
            estimate = float(features(scorer, interpret["backend"], batches) @ coef)
            penalty = interpret["seconds"] / estimate
        profile = profile_from(coef, dtype, penalty, command)
        profile.save(args.out)

    model = selection.CostModel(profile)
    print(f"\n{'| query, items, item tokens | split | ' + ' | '.join(compiled)} | auto | "
          "auto / fastest |")  # fmt: skip
    print("|---" * (len(compiled) + 4) + "|")
    failures, records = 0, []
    for g in points:
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
    print(f"# load average while timing: {load.get('before')} before, {load.get('after')} after")
    if args.measurements:
        with open(args.measurements, "w") as f:
            json.dump({"command": command, "profile": attrs.asdict(profile), "points": records,
                       "interpret": interpret, "load": load}, f, indent=1)  # fmt: skip
            f.write("\n")
    return 1 if failures else 0


def _load() -> str:
    """The 1, 5 and 15-minute load averages: the machine's other work while timing."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    sys.exit(main())
