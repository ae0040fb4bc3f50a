"""The lazy-graph part of ``dropbp check``: step boundaries and the compilation bound, observed.

On a device that compiles one graph per drop pattern (the backend sets a pattern bound: Gaudi in lazy mode),
:func:`graph_checks` observes through the backend's own compilation counter, not by assumption, that each step is
cut into a forward+backward graph and an update graph (a graph break right after ``backward`` and right after the
optimizer step), and that the graph cache stops growing once every pattern of the bounded pool has been seen. Where
every graph came from a cache (the counter never moves) the placement cannot be observed and the checks say so
(SKIP) rather than pass. How each is observed: docs/backends.md ("What `dropbp check` observes in lazy mode").
"""

from __future__ import annotations

import torch

from dropbp import apply
from dropbp.tools.check_grads import Probe
from dropbp.tools.check_report import FAIL, PASS, SKIP, Outcome
from dropbp.tools.device_tools import tools_for

__all__ = ["graph_checks"]

BREAK_AFTER_BACKWARD = "graph-break-after-backward"
BREAK_AFTER_OPTIMIZER = "graph-break-after-optimizer-step"
COMPILATIONS_BOUNDED = "compilations-stop-at-pattern-bound"
_NAMES = (BREAK_AFTER_BACKWARD, BREAK_AFTER_OPTIMIZER, COMPILATIONS_BOUNDED)


def _skip_all(reason: str) -> list[Outcome]:
    return [Outcome(n, SKIP, reason) for n in _NAMES]


def graph_checks(probe: Probe, cycles: int = 3) -> list[Outcome]:
    """The three lazy-graph checks, training ``cycles`` passes over the pattern pool at rate 0.5.

    Run on a fresh model before anything else compiles its step graphs. The update uses SGD with
    momentum at learning rate 0: one update graph per pattern (as Habana's fused optimizers give)
    that leaves the weights as they were for the checks that follow.
    """
    backend = probe.backend
    compilations = tools_for(backend).graph_compilations
    bound = backend.default_max_patterns
    if bound is None:  # one line, not three: nothing of this applies to eager devices
        reason = f"{backend.name} compiles no graph per drop pattern (eager kernels): no graph breaks or bound to check"
        return [Outcome("lazy-graph-checks", SKIP, reason)]
    if compilations() is None:
        return _skip_all(f"{backend.name} reports no compilation count here, so graphs cannot be counted")
    ctl = apply(probe.model, 0.5, seed=0, pattern="uniform", backend=backend)
    trainable = [p for p in probe.model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=0.0, momentum=0.9)
    rises: list[tuple[int, int, int]] = []  # per step: compilations during forward, backward, update
    totals: list[int] = []
    patterns: list[tuple[str, ...]] = []
    try:
        for _ in range(cycles * bound):
            start = compilations()
            loss = probe.loss()
            before = compilations()
            ctl.backward(loss)
            after_backward = compilations()
            ctl.optimizer_step(optimizer)
            end = compilations()
            optimizer.zero_grad(set_to_none=True)
            rises.append((before - start, after_backward - before, end - after_backward))
            totals.append(end)
            patterns.append(ctl.last_dropped)
    finally:
        ctl.remove()
    distinct = len(set(patterns))
    grown = totals[-1] - totals[-bound - 1]
    figures = {
        "steps": len(totals),
        "pattern_bound": bound,
        "distinct_patterns": distinct,
        "compilations": totals[-1] - totals[0] + sum(rises[0]),
        "compilations_in_last_pass": grown,
        "rises_per_step": rises,
    }
    if not any(sum(r) for r in rises):
        return _skip_all("no graph was compiled in the whole run (all cached?): break placement not observable")
    outcomes = []
    for name, phase, where in ((BREAK_AFTER_BACKWARD, 1, "backward"), (BREAK_AFTER_OPTIMIZER, 2, "optimizer step")):
        seen = sum(r[phase] > 0 for r in rises)
        if seen:
            outcomes.append(Outcome(name, PASS, f"graphs compiled at the break after the {where} in {seen} steps"))
        else:
            detail = f"no graph ever compiled at the {where}: the step boundary after it is missing"
            outcomes.append(Outcome(name, FAIL, detail, {"rises_per_step": rises}))
    detail = (
        f"{figures['compilations']} graphs for {distinct} distinct patterns (bound {bound}) in {len(totals)} steps; "
        f"{grown} new in the last {bound} steps"
    )
    ok = distinct <= bound and grown == 0
    outcomes.append(Outcome(COMPILATIONS_BOUNDED, PASS if ok else FAIL, detail, figures))
    return outcomes
