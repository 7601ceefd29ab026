"""Selection: what "auto" runs, by each built-in backend's estimated time and peak memory.

The candidates are the backends registered with `auto=True` (`registry.candidates()`: the
built-in ones but reference, and any a user opts in). Each plans the call (`plan(batches)`: its
own bucketing, chunking, batching and prefix-cache hits) and prices that plan's steps
(`price(plan)`) as `work.StepWork`; the winner's plan is the one that runs (`Choice`). A device
profile (`tpuscore.engine.profiles`) prices each step:

    seconds = step_seconds + flops / matmul rate + bytes / bandwidth + scores * score_seconds

and on a mesh the work divides over its devices (weights over "model" only). auto takes the
least time among the backends whose estimated peak memory fits their budget; item_first goes to
the fallback (serial, `Capabilities.fallback`); a backend that would run its Pallas kernel in
interpret mode is never picked. If nothing fits, the fallback, whose steps then hold one item
each. A pick whose steps would not fit the device's
free memory at all raises `sequence_too_long`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import attrs
import jax

from tpuscore.api.errors import ValidationError
from tpuscore.backends import budgets, contract, registry, work
from tpuscore.backends.contract import ScoreBatch
from tpuscore.backends.pool import BackendPool
from tpuscore.engine.profiles import DeviceProfile, for_device
from tpuscore.models.model import Model

logger = logging.getLogger(__name__)


@attrs.frozen
class Estimate:
    """One backend's estimate for a call: `seconds`, `peak_bytes` on one device against its
    `budget_bytes`, and its device `steps`. `eligible`: auto may pick it (it can run the
    requests, compiled)."""

    backend: str
    seconds: float
    peak_bytes: int
    budget_bytes: int
    steps: int
    eligible: bool

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.budget_bytes


@attrs.frozen
class Plan:
    """What `Scorer.plan` returns: every candidate backend's estimate, and `pick`, the backend
    auto runs."""

    pick: str
    estimates: tuple[Estimate, ...]

    def __getitem__(self, backend: str) -> Estimate:
        return next(e for e in self.estimates if e.backend == backend)


@attrs.frozen(eq=False)
class Choice:
    """A selector's pick with the plan it priced: `backend` runs `plan`, whose steps are
    `work`."""

    backend: str
    plan: contract.Plan
    work: tuple[work.StepWork, ...]


class CostModel:
    """The default `Selector`: the least estimated time among backends that fit (module doc)."""

    def __init__(self, profile: DeviceProfile | None = None, platform: str | None = None):
        """profile: default the built-in one of this device kind. platform: where the backends
        run ("cpu", "gpu", "tpu"; default this process's), which says which run compiled."""
        self.profile = profile or for_device()
        self.platform = platform or jax.default_backend()

    def select(self, batches: Sequence[ScoreBatch], pool: BackendPool) -> Choice:
        """The backend auto runs for these groups (all item_first, or none), with its plan."""
        plan, priced = self._estimates(batches, pool, eligible_only=True)
        return Choice(plan.pick, *priced[plan.pick])

    def plan(
        self, batches: Sequence[ScoreBatch], pool: BackendPool, *, eligible_only: bool = False
    ) -> Plan:
        """The candidates' estimates for scoring these groups together (eligible_only: just
        those auto may pick), and the pick."""
        return self._estimates(batches, pool, eligible_only=eligible_only)[0]

    def _estimates(
        self, batches: Sequence[ScoreBatch], pool: BackendPool, *, eligible_only: bool
    ) -> tuple[Plan, dict[str, tuple[contract.Plan, tuple[work.StepWork, ...]]]]:
        """`plan`, and each candidate's plan with its priced steps."""
        item_first = any(b.item_first for b in batches)
        adapter = any(b.adapter for b in batches)
        estimates, priced = [], {}
        for name in registry.candidates():
            capabilities = registry.registration(name).capabilities
            eligible = (
                capabilities.compiled(self.platform)
                and (capabilities.item_first or not item_first)
                and (capabilities.adapters or not adapter)
            )
            if eligible or not eligible_only:
                backend = pool.get(name)
                plan = backend.plan(batches)
                priced[name] = (plan, tuple(backend.price(plan)))
                estimates.append(
                    self.estimate(name, backend, priced[name][1], pool.model, eligible)
                )
        by_name = {e.backend: e for e in estimates}
        fitting = [e for e in estimates if e.eligible and e.fits]
        if fitting and not item_first:
            pick = min(fitting, key=lambda e: e.seconds)
        else:
            pick = by_name[registry.fallback()]  # whose steps hold one item each when nothing fits
        logger.debug(
            "auto picks %s: %s", pick.backend,
            ", ".join(
                f"{e.backend} {e.seconds:.3g} s {e.peak_bytes / 2**20:.0f}/"
                f"{e.budget_bytes / 2**20:.0f} MiB{'' if e.eligible else ' (not eligible)'}"
                for e in estimates
            ),
        )  # fmt: skip
        return Plan(pick.backend, tuple(estimates)), priced

    def estimate(
        self,
        name: str,
        backend: contract.Backend,
        steps: Sequence[work.StepWork],
        model: Model,
        eligible: bool,
    ) -> Estimate:
        """A backend's time and peak memory for the priced steps of its plan."""
        compiled = registry.registration(name).capabilities.compiled(self.platform)
        penalty = 1 if compiled else self.profile.interpret_penalty
        return Estimate(
            backend=name,
            seconds=self.seconds(steps, model) * penalty,
            peak_bytes=max((s.peak for s in steps), default=0),
            budget_bytes=backend.peak_budget,
            steps=len(steps),
            eligible=eligible,
        )

    def seconds(self, steps: Sequence[work.StepWork], model: Model) -> float:
        """The steps' time on the model's devices: the work divides over the mesh (weights,
        and so their bytes, over its "model" axis only)."""
        p, layout = self.profile, model.layout
        devices = layout.data * layout.model
        flops = sum(s.flops for s in steps) / (p.matmul_rate(model.matmul_dtype) * devices)
        reads = sum(s.bytes for s in steps) / (p.memory_bandwidth * layout.model)
        scores = sum(s.scores for s in steps) * p.score_seconds / devices
        return len(steps) * p.step_seconds + flops + reads + scores


def check_fits(name: str, backend: contract.Backend, steps: Sequence[work.StepWork]) -> None:
    """ValidationError("sequence_too_long") if the largest of a backend's priced steps cannot
    fit the device's free memory."""
    peak = max((s.peak for s in steps), default=0)
    if peak == 0:
        return  # nothing priced (a backend with no estimates): nothing to check
    capacity = budgets.device_capacity()
    if peak > capacity:
        raise ValidationError(
            "sequence_too_long",
            f"the largest step on {name} needs about {peak / 2**20:.0f} MiB, even split to fit "
            f"its {backend.budget / 2**20:.0f} MiB budget, and the device has "
            f"{capacity / 2**20:.0f} MiB free; shorten the query or the items (max_item_tokens)",
            "items",
        )
