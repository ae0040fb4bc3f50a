"""Which token rows of a kept branch's backward run, and with what weight: numbers only.

A branch's backward is linear in the gradient arriving at its output, one row per token. Keeping a row ``t`` with
probability ``p_t`` and scaling it by ``1 / p_t`` gives an unbiased estimate of the branch's whole backward (its
parameters' gradients and the gradient it passes down). The rules (``token_selection``):

- ``"gradient"`` (importance sampling, VCAS's rule): ``p_t`` proportional to the row's gradient norm, capped at 1
  (:func:`inclusion_probabilities`): rows that carry more gradient are kept more often, so a kept row is worth more;
- ``"residual"`` (TokenDrop's importance, from the forward): ``p_t`` proportional to the norm of the row the branch
  adds to the residual stream, capped at 1, weighted as ``"gradient"``;
- ``"random"`` (the control): the same probability for every row that carries any gradient;
- ``"cumulative"`` (TokenDrop's cumulative selection): the first kept branch whose backward runs in a forward (the
  topmost) draws its rows as ``"gradient"`` does, and every branch below keeps the same rows with the same weights -
  dropped at a layer, dropped below it. Not unbiased: a kept row's weight reaches the branches below twice (through
  the gradient they receive and through their own selection), so it is a measured control, not a default.

``token_drop_rate="auto"`` (VCAS's variance control, per branch): after each training forward, each branch keeps the
smallest share of :data:`AUTO_KEEP_SHARES` whose added variance, as measured on its recent gradients
(:func:`added_variance`, smoothed over forwards), is at most :data:`AUTO_VARIANCE_BUDGET` of the variance the token rows
carry (:func:`auto_keep_share`); a branch with no reading yet keeps every row.

Rows whose gradient is exactly zero (padding, and tokens nothing downstream reads) get ``p_t = 0``: never kept. Exactly
``keep`` rows are drawn (fewer only when fewer rows carry gradient), by systematic sampling over a random order
(:func:`systematic_sample`): each row's marginal is exactly ``p_t`` and the count is fixed, so the shapes that follow
are static. Only operations a lazy-graph device compiles into its graph are used (no indexing by a tensor read on the
host, no scatter or ``where``). The random order and offset come from the caller (a generator seeded by seed, step and
branch), so a selection is a function of them and the gradient: it resumes exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = [
    "AUTO_KEEP_SHARES",
    "AUTO_VARIANCE_BUDGET",
    "TOKEN_SELECTIONS",
    "RankedScores",
    "added_variance",
    "added_variance_at",
    "auto_keep_share",
    "inclusion_probabilities",
    "keep_count",
    "sampled_weights",
    "selection_scores",
    "selection_weights",
    "systematic_sample",
    "token_shares",
]

#: The selection rules, the default first.
TOKEN_SELECTIONS = ("gradient", "residual", "random", "cumulative")
#: ``token_drop_rate="auto"``: the shares of rows a branch may keep (few, so that a lazy-graph device, whose graphs
#: are keyed by the keep count, compiles few graphs), the last keeping every row.
AUTO_KEEP_SHARES = (0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0)
#: ``token_drop_rate="auto"``: the variance a selection may add, as a fraction of the variance of the gradient's
#: token rows (:func:`added_variance`); where the rows' gradient noise dominates, a step is then worth at least about
#: ``1 / (1 + budget)`` of a full one.
AUTO_VARIANCE_BUDGET = 0.1
_TINY = 1e-30


def keep_count(rows: int, token_drop_rate: float) -> int:
    """Rows a branch's backward keeps at ``token_drop_rate``: ``ceil((1 - rate) * rows)``, at least 1."""
    return max(1, min(rows, math.ceil(round((1.0 - token_drop_rate) * rows, 6))))


def inclusion_probabilities(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """``p_t = min(1, c * scores_t)`` with ``c`` such that ``sum p = keep`` (capped probability proportional to size).

    ``scores`` are non-negative, one per row. Where fewer than ``keep`` rows have a positive score, every such row gets
    1 (and the rest 0). Vectorised with static shapes: the rows capped at 1 are the ``j`` largest, for the smallest
    ``j`` whose remaining ``keep - j`` can be spread over the other rows without any exceeding 1.
    """
    return RankedScores(scores).probabilities((keep,))[0]


class RankedScores:
    """A branch's selection scores sorted once (largest first, with the tail sums of the sorted scores), so that one
    selection and every keep count ``token_drop_rate="auto"`` reads share a single sort (and, under "auto", a single
    computation of the probabilities: the share in force is one of the counts read)."""

    __slots__ = ("scores", "ordered", "tails")

    def __init__(self, scores: torch.Tensor) -> None:
        self.scores = scores.float()
        self.ordered, _ = torch.sort(self.scores, descending=True)
        self.tails = torch.flip(torch.cumsum(torch.flip(self.ordered, (0,)), 0), (0,))  # sum from each position on

    def probabilities(self, keeps: Sequence[int]) -> torch.Tensor:
        """:func:`inclusion_probabilities` of these scores for each count of ``keeps``: one row per count, computed
        for all counts at once (a few tensor operations, whatever the number of counts)."""
        shape = (len(keeps), self.scores.shape[0])
        # one count stays a number (no copy to the device: a selection's only count); several are one small tensor
        counts = keeps[0] if len(keeps) == 1 else self.scores.new_tensor(keeps)[:, None]
        capped = torch.cumsum(torch.ones_like(self.scores), 0) - 1  # j = 0, 1, ..., rows - 1
        # c_j: the factor with the j largest rows capped; only j < keep can be capped, and the largest uncapped row
        # must stay at most 1
        scale = ((counts - capped) / self.tails.clamp_min(_TINY)).expand(shape)
        fits = ((capped < counts) & (scale * self.ordered <= 1.0)).expand(shape)
        # the smallest j that fits (one always does: j = keep - 1, or a row of score 0), as a one-hot mask: reductions
        # and element-wise operations only, so that a lazy-graph device compiles one graph whatever j is (indexing by
        # j does not: it reads j on the host and bakes it into the graph)
        first = fits & (torch.cumsum(fits.to(self.ordered.dtype), 1) == 1)
        return torch.clamp((scale * first).sum(1, keepdim=True) * self.scores, max=1.0)


def sampled_weights(probabilities: torch.Tensor, order: torch.Tensor, offset: torch.Tensor, keep: int) -> torch.Tensor:
    """Per row, ``1 / p_t`` where the row is kept (drawn by :func:`systematic_sample`) and 0 elsewhere."""
    taken = systematic_sample(probabilities, order, offset, keep)
    return taken / probabilities.clamp_min(_TINY)  # taken is 0 or 1, and 1 only where p > 0


def systematic_sample(
    probabilities: torch.Tensor, order: torch.Tensor, offset: torch.Tensor, keep: int
) -> torch.Tensor:
    """A 0/1 mask with ``P(row t) = probabilities[t]`` and at most ``keep`` rows (``sum p``, their count) in all.

    Walks the rows in ``order`` (a permutation) and takes row ``t`` where the running sum of probabilities passes
    ``offset + m`` for ``m = 0, ..., keep - 1`` (``offset`` uniform in ``[0, 1)``): systematic sampling. Each row is
    taken at most once (``p_t <= 1``). Each row's start is the previous row's end, the same float (recomputed as
    ``end - p_t`` it can round to the other side of a point, and the point is counted twice), and the points stop at
    ``keep - 1`` (a float32 running sum of thousands of rows can end a rounding error past ``keep``): a ``keep + 1``-th
    row weighted but not gathered would bias the gradient; a row missed by a rounding error below ``keep`` is
    gathered with weight 0, which is exact.
    """
    walked = probabilities.index_select(0, order)
    after = torch.cumsum(walked, 0) - offset
    before = torch.cat([-offset.reshape(1).to(after.dtype), after[:-1]])
    # ceil(x) as -floor(-x): with torch.ceil the lazy engine compiled 179 graphs where floor's 33 sufficed
    # (tests/test_lazy_engine.py's count of token drops' graphs)
    taken = ((-torch.floor(-after)).clamp(max=keep) > (-torch.floor(-before)).clamp(max=keep)).to(probabilities.dtype)
    return taken.index_select(0, torch.argsort(order))  # back to row order


def selection_scores(row_norms: torch.Tensor, rule: str, residual_norms: torch.Tensor | None = None) -> torch.Tensor:
    """What a rule's inclusion probabilities are proportional to, per row (0 for rows carrying no gradient)."""
    carries = (row_norms > 0).to(row_norms.dtype)
    if rule == "residual":
        if residual_norms is None:
            raise ValueError("token_selection='residual' needs the branch output's row norms from the forward")
        residual = residual_norms.to(row_norms.dtype) * carries
        # a row carrying gradient whose forward output is 0 (a zero-initialised output projection: every row) must
        # still be drawable, or its gradient is never kept (biased): every carrying row's score is raised by a tenth
        # of their mean (a defensive mixture: the weights stay bounded), and where all are 0 they are alike
        mean = residual.sum() / carries.sum().clamp_min(1.0)
        floor = torch.where(mean > 0, 0.1 * mean, torch.ones_like(mean))
        return residual + floor * carries
    return row_norms if rule in ("gradient", "cumulative") else carries


def added_variance(row_norms: torch.Tensor, scores: torch.Tensor, keeps: tuple[int, ...]) -> torch.Tensor:
    """Per keep count, the variance a weighted selection of that many rows adds, over the rows' own:
    ``sum_t (1 / p_t - 1) |g_t|^2 / sum_t |g_t|^2``, with ``p_t`` the inclusion probabilities from ``scores``.

    The numerator is the added variance of the selected, reweighted gradient rows (each kept independently with
    ``p_t``); the denominator is what the rows' gradient varies by if tokens are taken as the samples of a
    noise-dominated batch. A row carrying gradient that a rule never keeps (``p_t = 0``) makes it huge (biased).
    """
    return added_variance_at(row_norms, RankedScores(scores).probabilities(keeps))


def added_variance_at(row_norms: torch.Tensor, probabilities: torch.Tensor) -> torch.Tensor:
    """:func:`added_variance` from the inclusion probabilities already computed (one row per keep count)."""
    squares = row_norms.float().pow(2)
    total = squares.sum().clamp_min(_TINY)
    readings = ((1.0 / probabilities.clamp_min(_TINY) - 1.0) * squares).sum(1) / total
    return readings.clamp(max=1 / _TINY)  # finite: a state holding it is checked as numbers


def auto_keep_share(readings: list[float], budget: float = AUTO_VARIANCE_BUDGET) -> float:
    """The smallest share of :data:`AUTO_KEEP_SHARES` whose reading (:func:`added_variance`, one per share) is at
    most ``budget``; every row (1.0) where none is."""
    return next((share for share, added in zip(AUTO_KEEP_SHARES, readings, strict=True) if added <= budget), 1.0)


def selection_weights(
    row_norms: torch.Tensor,
    keep: int,
    rule: str,
    order: torch.Tensor,
    offset: torch.Tensor,
    residual_norms: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per row, ``1 / p_t`` where the row is kept and 0 elsewhere: the factor on its gradient.

    Args:
        row_norms: the norm of each row's gradient at the branch output.
        keep: how many rows to keep (:func:`keep_count`).
        rule: one of :data:`TOKEN_SELECTIONS` (``"cumulative"`` draws as ``"gradient"``: its sharing is the caller's).
        order: a random permutation of the rows; offset: a uniform number in ``[0, 1)`` (one-element tensor).
        residual_norms: for ``"residual"``, the norm of each row of the branch's output in the forward.
    """
    probabilities = RankedScores(selection_scores(row_norms, rule, residual_norms)).probabilities((keep,))[0]
    return sampled_weights(probabilities, order, offset, keep)


def token_shares(shares: list[float], chosen: dict[int, float], one_share: bool) -> list[float]:
    """The keep share of every branch under ``TokenDrops("auto")``, from those in force (``shares``) and those the
    readings now allow (``chosen``, by branch index, for the branches read so far): each read branch its own; with
    ``one_share`` (a device that compiles every distinct graph: a step's graph is keyed by each branch's row count, so
    per-branch shares would compile a graph per combination) one share for every branch, the largest a read branch
    asks for (so every read branch's added variance stays within the budget)."""
    if one_share and chosen:
        return [max(chosen.values())] * len(shares)
    return [chosen.get(index, share) for index, share in enumerate(shares)]
