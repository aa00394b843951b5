"""The checkpoint interval that loses the least time, from what a save costs and how often the job fails.

A run that checkpoints every ``T`` seconds of training, pays ``C`` seconds of its training loop per checkpoint and
fails on average every ``M`` seconds loses, per unit of time, about ``C / T`` to checkpointing and ``(T / 2 + R) /
M`` to the work redone after failures (``R``: what a restart costs, which no interval changes). Young's interval
``sqrt(2 C M)`` minimises the sum to first order; Daly's higher-order one, used here,
``sqrt(2 C M) (1 + x / 3 + x^2 / 9) - C`` with ``x = sqrt(C / (2 M))`` (``M`` when ``C >= 2 M``), stays right when
saves are not cheap next to failures. ``benchmarks/checkpoint_interval.py`` checks it against a sweep of fixed
intervals in a simulation of failures.

:class:`IntervalPlanner` turns it into steps for one tier: ``C`` is the median time the training loop was blocked
by the tier's recent saves (the whole save when it is synchronous), the step time the median of recent steps with
saves taken out, ``M`` the given mean time between failures or the one the run's record learned.
"""

from __future__ import annotations

import logging
import math
import re
import statistics
import time
from collections import deque
from typing import Any

from ..errors import ConfigError

__all__ = ["daly_interval", "young_interval", "parse_duration", "IntervalPlanner", "DEFAULT_MTBF_S",
           "two_tier_interval", "two_tier_loss", "plan_two_tiers", "DEFAULT_MEMORY_SHARE", "span"]

DEFAULT_MTBF_S = 24 * 3600.0
"""The mean time between failures assumed when none is given and the run has recorded none (said in the log)."""
DEFAULT_MEMORY_SHARE = 0.9
"""The share of failures the memory tier is assumed to recover from before the run's restores tell (said in the
log): it survives a process or a node lost, not the whole job."""
_MAX_RATIO = 10_000
_UNITS = {"s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION = re.compile(r"\s*((?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)\s*(s|min|m|h|d|w)?\s*")
_WINDOW = 20
"""Recent saves and steps the medians are taken over."""


def young_interval(cost_s: float, mtbf_s: float) -> float:
    """Young's first-order interval, ``sqrt(2 C M)`` seconds."""
    return math.sqrt(2 * cost_s * mtbf_s)


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Seconds of training between checkpoints that minimise the expected lost time (Daly's higher-order
    estimate)."""
    if cost_s <= 0:
        return 0.0
    if cost_s >= 2 * mtbf_s:
        return mtbf_s
    x = math.sqrt(cost_s / (2 * mtbf_s))
    return math.sqrt(2 * cost_s * mtbf_s) * (1 + x / 3 + x * x / 9) - cost_s


def two_tier_loss(memory_every_s: float, ratio: int, memory_cost_s: float, durable_cost_s: float, mtbf_s: float,
                  memory_share: float) -> float:
    """The share of time lost (first order) with a memory snapshot every ``memory_every_s`` seconds of training and
    every ``ratio``-th of them made durable instead: checkpointing costs ``((ratio - 1) Cm + Cd) / (ratio T)``; a
    failure the memory tier recovers from (a share ``p``) redoes ``T / 2`` on average, any other ``ratio T / 2``."""
    t = memory_every_s
    saving = ((ratio - 1) * memory_cost_s + durable_cost_s) / (ratio * t)
    return saving + (memory_share * t / 2 + (1 - memory_share) * ratio * t / 2) / mtbf_s


def two_tier_interval(memory_cost_s: float, durable_cost_s: float, mtbf_s: float,
                      memory_share: float) -> tuple[float, int]:
    """Both tiers' intervals together: seconds between memory snapshots and how many of those apart the durable
    saves are, minimising :func:`two_tier_loss` (for each ratio the best interval is
    ``sqrt(2 M ((k - 1) Cm + Cd) / k / (p + (1 - p) k))``; the ratio is searched until the loss rises for good).
    With ``p = 0`` it is Young's interval of the durable tier and a ratio of 1."""
    memory_cost_s, durable_cost_s = (min(MAX_COST_S, max(MIN_COST_S, c)) for c in (memory_cost_s, durable_cost_s))
    mtbf_s = min(MAX_DURATION_S * 1e3, max(MIN_MTBF_S, mtbf_s))  # no product of them underflows to 0 s
    best: tuple[float, float, int] | None = None
    for ratio in range(1, _MAX_RATIO + 1):
        per_save = ((ratio - 1) * memory_cost_s + durable_cost_s) / ratio
        t = math.sqrt(2 * mtbf_s * per_save / (memory_share + (1 - memory_share) * ratio))
        loss = two_tier_loss(t, ratio, memory_cost_s, durable_cost_s, mtbf_s, memory_share)
        if best is None or loss < best[0]:
            best = (loss, t, ratio)
        elif ratio > 2 * best[2] + 8:  # the loss is convex in the ratio past its minimum
            break
    assert best is not None
    return best[1], best[2]


def plan_two_tiers(memory: "IntervalPlanner", durable: "IntervalPlanner", share: float,
                   share_source: str) -> tuple[int | None, int | None]:
    """Rank 0: both ``"auto"`` intervals in steps, chosen together (:func:`two_tier_interval`), each within its
    planner's bounds; the durable one a multiple of the memory one. Each planner's ``reason`` says why."""
    if not memory.step_times:
        return None, None
    step_s = statistics.median(memory.step_times)
    (c_mem, said_mem), (c_dur, said_dur) = memory.cost(), durable.cost()
    mtbf, source = durable.mtbf_s
    t, ratio = two_tier_interval(c_mem, c_dur, mtbf, share)
    mem_steps = memory.bounded(steps_for(t, step_s))
    dur_steps = durable.bounded(mem_steps * min(ratio, MAX_STEPS // mem_steps))  # at most MAX_STEPS, a multiple
    mem_steps = min(mem_steps, dur_steps)  # a durable maximum below the memory interval: no snapshot in between
    ratio = max(1, dur_steps // mem_steps)
    common = (f"a step takes {step_s:.3g} s, one failure per {span(mtbf)} ({source}), the memory tier recovers "
              f"from {share:.0%} of them ({share_source})")
    memory.reason = f"a memory snapshot {said_mem} {c_mem:.3g} s, a durable save {said_dur} {c_dur:.3g} s, {common}"
    durable.reason = (f"every {ratio} memory snapshot(s) made durable: a durable save {said_dur} {c_dur:.3g} s, a "
                      f"memory snapshot {said_mem} {c_mem:.3g} s, {common}")
    return mem_steps, dur_steps


MAX_STEPS = 10**12
"""No interval is longer than this many steps (what a degenerate step time would otherwise make infinite)."""
MAX_DURATION_S = 100 * 365 * 86400.0
"""The longest duration a field takes: a century."""
MIN_MTBF_S = 1e-3
"""A mean time between failures below a millisecond is no estimate (what starts at one instant give): refused when
given, the default when learned."""
MIN_COST_S = 1e-9
"""A save that blocked less than a nanosecond (0 s, a denormal time) measured no cost: the first estimate stands."""
MAX_COST_S = 1e12


def steps_for(seconds: float, step_s: float) -> int:
    """``seconds`` in steps of ``step_s``: at least 1, at most :data:`MAX_STEPS`, whatever the numbers (a step time
    of 5e-324 s, an infinite interval)."""
    ratio = seconds / step_s if step_s > 0 and math.isfinite(step_s) else math.inf
    if math.isnan(ratio):
        return 1
    return int(max(1, min(MAX_STEPS, round(ratio) if math.isfinite(ratio) else MAX_STEPS)))


def parse_duration(value: Any, what: str) -> float:
    """Seconds from a number (seconds) or a text such as ``"90s"``, ``"30m"``, ``"6h"``, ``"2d"``, ``"1w"``,
    ``"1.5e3s"``: between :data:`MIN_MTBF_S` and :data:`MAX_DURATION_S`, else a :class:`ConfigError` naming
    ``what`` (never an ``OverflowError``, whatever the number)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number: Any = value
        unit: float = 1
    elif isinstance(value, str) and (m := _DURATION.fullmatch(value)):
        number, unit = m.group(1), _UNITS[m.group(2) or "s"]
    else:
        raise ConfigError(f"{what} must be a duration such as 6h, 30m, 2d or a number of seconds, got {value!r:.80}")
    try:
        seconds = float(number) * unit
    except OverflowError:  # an integer beyond floats
        seconds = math.inf if number > 0 else -math.inf  # type: ignore[operator]
    if math.isnan(seconds) or seconds <= 0:
        raise ConfigError(f"{what} must be a positive duration, got {value!r:.80}")
    if seconds > MAX_DURATION_S:
        raise ConfigError(f"{what} must be at most a century ({MAX_DURATION_S:.0f} s), got {value!r:.80}")
    if seconds < MIN_MTBF_S:
        raise ConfigError(f"{what} must be at least a millisecond, got {value!r:.80}")
    return seconds


def basis(failures: int, up_s: float) -> str:
    """What a learned MTBF rests on, said as such: ``"1 failure in 2.5 h observed; one failure: a rough estimate"``."""
    rough = "; one failure: a rough estimate" if failures == 1 else ""
    return f"{failures} failure{'s' if failures != 1 else ''} in {span(up_s)} observed{rough}"


def span(seconds: float | None) -> str:
    """``seconds`` as a reader takes it (``"6 h"``, ``"2.5 min"``, ``"0.3 s"``; ``"-"`` for ``None``)."""
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.3g} s"


class IntervalPlanner:
    """Chooses how many steps apart one tier's saves are (``tier``: ``"durable"`` or ``"memory"``).

    Every rank holds one; only rank 0's measurements count, and the manager hands its choice to every rank at
    points all ranks reach together (:meth:`choice` / :meth:`agree`), so that they save at the same steps."""

    def __init__(self, tier: str, *, mtbf_s: float | None, learned_mtbf_s: float | None, min_steps: int = 1,
                 max_steps: int | None = None, first_cost_s: float = 1.0, log: logging.Logger | None = None,
                 learned_failures: int = 1) -> None:
        self.tier, self.min_steps, self.max_steps = tier, min_steps, max_steps
        self.given_mtbf_s, self.learned_mtbf_s = mtbf_s, learned_mtbf_s
        self.learned_failures = max(1, learned_failures)
        self._born = time.monotonic()  # this process's running counts as uptime without a failure
        self.first_cost_s = first_cost_s
        self.log = log or logging.getLogger("ckptio")
        self.costs: deque[float] = deque(maxlen=_WINDOW)
        self.step_times: deque[float] = deque(maxlen=_WINDOW * 5)
        self.every: int | None = None
        """The interval in steps every rank uses (``None`` until the first choice)."""
        self.last_saved: int | None = None
        self.reason = ""
        self._seen: tuple[int, float] | None = None
        self._paused = 0.0

    @property
    def mtbf_s(self) -> tuple[float, str]:
        """The MTBF planned with and where it comes from: given; learned (a censored estimate: the uptime the
        record saw plus this process's running so far, over the failures); else :data:`DEFAULT_MTBF_S`."""
        if self.given_mtbf_s is not None:
            return self.given_mtbf_s, "given"
        learned = self.learned_mtbf_s
        if learned is not None and math.isfinite(learned) and learned >= MIN_MTBF_S:
            n = self.learned_failures
            up = learned * n + (time.monotonic() - self._born)  # the uptime before, and this process's so far
            return up / n, f"learned: {basis(n, up)}"
        return DEFAULT_MTBF_S, "assumed: set mtbf="

    def step_reached(self, step: int) -> None:
        """The training loop reached ``step`` (called once per step): its time, saves taken out, is measured."""
        now = time.perf_counter()
        if self._seen is not None and step > self._seen[0]:
            per_step = (now - self._seen[1] - self._paused) / (step - self._seen[0])
            if per_step > 0:
                self.step_times.append(per_step)
        self._seen, self._paused = (step, now), 0.0

    def saved(self, step: int, blocked_s: float) -> None:
        """A save of this tier at ``step`` blocked the training loop ``blocked_s`` seconds."""
        self.costs.append(blocked_s)
        self.last_saved = step
        self._paused += blocked_s

    def cost(self) -> tuple[float, str]:
        """What a save of this tier blocks the loop (the median of the recent ones, or the estimate before any)."""
        cost = statistics.median(self.costs) if self.costs else 0.0
        if MIN_COST_S <= cost <= MAX_COST_S:
            return cost, "blocks"
        # none measured yet, or none that is a cost (0 s, a denormal time): the estimate, within the same bounds
        return min(MAX_COST_S, max(MIN_COST_S, self.first_cost_s)), "is estimated to block"

    def bounded(self, steps: int) -> int:
        """``steps`` within the user's minimum and maximum."""
        steps = max(self.min_steps, steps)
        return min(self.max_steps, steps) if self.max_steps is not None else steps

    def choice(self) -> int | None:
        """The interval in steps the measurements so far give (``None`` before a step time is known)."""
        if not self.step_times:
            return None
        step_s = statistics.median(self.step_times)
        cost, measured = self.cost()
        mtbf, source = self.mtbf_s
        steps = self.bounded(steps_for(daly_interval(cost, mtbf), step_s))
        self.reason = (f"a {self.tier} save {measured} {cost:.3g} s, a step takes {step_s:.3g} s, one failure per "
                       f"{span(mtbf)} ({source})")
        return steps

    def agree(self, steps: int | None) -> None:
        """Every rank: use ``steps`` (rank 0's :meth:`choice`), logged when it changes by more than a tenth."""
        if steps is None:
            return
        if self.every is None or abs(steps - self.every) > 0.1 * self.every:
            self.log.info("Checkpoint interval (%s, auto): every %d steps: %s", self.tier, steps, self.reason or
                          "chosen on rank 0")
        self.every = steps

    def due(self, step: int) -> bool:
        """Whether this tier saves at ``step``: ``every`` steps after its last save (or after step 0)."""
        if self.every is None:
            return False
        return step - (self.last_saved or 0) >= self.every
