"""The token drops feature (:class:`TokenDrops`), experimental: measured, and no token arm pays in any cell of the
project's tables (docs/token-drops.md; on the H200 a token-dropped step is 0.54x a full one).

Each kept branch runs its backward on a share of its token rows, drawn by a selection rule and weighted by their
inverse probability (:mod:`dropbp.experimental.token_backward`, :mod:`dropbp.experimental.token_selection`). The
feature owns its rate (a number, or ``"auto"``: each branch's share chosen from its measured gradient rows), its rule,
its state (the automatic shares' readings) and its Trainer log; exact on every backend, as before.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from dropbp.checks import check_choice, check_fraction, check_number, check_sequence
from dropbp.experimental.token_backward import RowDropEngine, RowSlot
from dropbp.experimental.token_rows import recomputes_on_kept_rows, row_local_linears, row_ops
from dropbp.experimental.token_selection import AUTO_KEEP_SHARES, TOKEN_SELECTIONS
from dropbp.features.base import Feature, register_feature
from dropbp.features.host import Host

__all__ = ["TokenDrops"]

AUTO = "auto"


def _fixed_rate(value: object) -> float | None:
    """``rate`` resolved: the share of rows skipped, or None for ``"auto"`` (each branch's share its own)."""
    if isinstance(value, str) and value == AUTO:
        return None
    try:
        return check_fraction("rate", value)
    except (ValueError, TypeError) as error:
        raise type(error)(
            f"TokenDrops: {error}: it is the share of token rows whose backward each kept branch skips; set it to "
            "e.g. 0.5, 0 for none, or 'auto' (each branch's share chosen from its measured gradient rows)"
        ) from None


def check_token_shares(shares: object, branches: int) -> None:
    """``token_shares``: per branch, a keep share of AUTO_KEEP_SHARES and None or one reading per share."""
    name = "state['token_drops']"
    if not isinstance(shares, dict) or sorted(shares) != ["readings", "shares"]:
        raise ValueError(f"{name} must be a dict of shares and readings, got {shares!r:.80}")
    for key in ("shares", "readings"):
        values = check_sequence(f"{name}[{key!r}]", shares[key])
        if len(values) != branches:
            raise ValueError(f"{name}[{key!r}] has {len(values)} entries, the state {branches} branches")
    for i, share in enumerate(shares["shares"]):
        if share not in AUTO_KEEP_SHARES:
            raise ValueError(f"{name}['shares'][{i}] must be one of {AUTO_KEEP_SHARES}, got {share!r:.40}")
    for i, readings in enumerate(shares["readings"]):
        if readings is None:
            continue
        values = check_sequence(f"{name}['readings'][{i}]", readings)
        if len(values) != len(AUTO_KEEP_SHARES):
            raise ValueError(f"{name}['readings'][{i}] must hold {len(AUTO_KEEP_SHARES)} numbers, got {len(values)}")
        for j, value in enumerate(values):
            check_number(f"{name}['readings'][{i}][{j}]", value)


@register_feature
class TokenDrops(Feature):
    """Token drops on every kept branch; both settings may change after ``apply``, from the next training forward.

    Args:
        rate: the share of token rows whose backward each kept branch skips, in [0, 1): the gradient arriving at a
            kept branch's output keeps ``ceil((1 - rate) * rows)`` rows, weighted by their inverse probability (an
            unbiased estimate of the branch's backward), and the branch's row-local linear maps run their backward
            on those rows only. 0: nothing changes. ``"auto"``: each branch's share chosen after every training
            forward from its measured gradient rows, the fewest rows whose added variance stays within a tenth of
            the rows' own (every row until measured).
        selection: how rows are chosen: ``"gradient"`` (probability proportional to each row's gradient norm, capped
            at 1), ``"residual"`` (to the norm of the row the branch adds in the forward, TokenDrop's importance),
            ``"random"`` (the same for every row that carries gradient) or ``"cumulative"`` (the topmost kept
            branch's rows kept by every branch below: biased, a measured control).
    """

    key = "token_drops"

    def __init__(self, rate: float | str, selection: str = "gradient") -> None:
        super().__init__()
        self._fixed = _fixed_rate(rate)
        self._selection = check_choice("selection", selection, TOKEN_SELECTIONS)
        #: settings given while attached, (fixed rate or None for "auto", selection): in force from the next training
        #: forward, so that a backward under way (and checkpointing's recomputation in it) keeps its forward's
        self._given: tuple[float | None, str] | None = None

    @classmethod
    def from_config(cls, value: object) -> TokenDrops | None:
        """As :meth:`Feature.from_config` (a mapping: ``rate`` and ``selection``), and a number or ``"auto"`` is the
        rate; a rate of 0 is no feature."""
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):
            value = {"rate": value}
        if isinstance(value, dict) and value.get("rate") == 0:
            return None
        return super().from_config(value)  # type: ignore[return-value]

    @classmethod
    def from_flat(cls, settings: dict[str, Any]) -> TokenDrops | None:
        rate, selection = settings.pop("token_drop_rate", 0.0), settings.pop("token_selection", "gradient")
        return None if rate == 0 else cls(rate, selection)

    def config(self) -> dict[str, Any]:
        return {"rate": self.rate, "selection": self.selection}

    @property
    def rate(self) -> float | str:
        """The share of token rows skipped (or ``"auto"``): the latest given; settable (in force from the next
        training forward)."""
        fixed = self._fixed if self._given is None else self._given[0]
        return AUTO if fixed is None else fixed

    @rate.setter
    def rate(self, value: float | str) -> None:
        self._give(_fixed_rate(value), self.selection)

    @property
    def selection(self) -> str:
        """The selection rule: the latest given; settable (in force from the next training forward)."""
        return self._selection if self._given is None else self._given[1]

    @selection.setter
    def selection(self, value: str) -> None:
        fixed = self._fixed if self._given is None else self._given[0]
        self._give(fixed, check_choice("selection", value, TOKEN_SELECTIONS))

    def _give(self, fixed: float | None, selection: str) -> None:
        if self._part is None:  # not attached: nothing under way
            self._fixed, self._selection = fixed, selection
        else:
            self._given = (fixed, selection)

    def _settle(self) -> None:
        """At a training forward's start: the settings given since the last one come into force."""
        if self._given is None:
            return
        (self._fixed, self._selection), self._given = self._given, None
        if self._fixed is not None:
            self._part.clear_auto()

    def attach(self, host: Host) -> None:
        super().attach(host)
        found = [row_local_linears(b) for b in host.branches]
        self._rows = row_ops(host.backend)
        self._part = RowDropEngine(
            [b.parts for b in host.branches],
            [linears for linears, _ in found],
            self._rows,
            self._slot,
            [recomputes_on_kept_rows(b) for b in host.branches],
        )
        self._part.install()
        self._part.warn_full_rows([name for _, names in found for name in names])
        self._part.before_forward = self._settle
        host.hooks.listen(self._part)
        if any(f.key == "noise_scale" for f in host.given().features):
            warnings.warn(
                "dropbp: the noise scale read while token drops are on counts their row sampling's variance as data "
                "noise (it reads above B_simple), and drop_rate=\"auto\" reads it: measure the noise "
                "scale with token drops off (TokenDrops(0.0), or dropbp check --model PATH --data FILE)",
                stacklevel=2,
            )

    def _slot(self, index: int) -> RowSlot | None:
        """The selection a call of branch ``index`` makes now; None where it makes none (rate 0, the branch dropped,
        calibration's forced forwards, outside a training forward of the model or its recomputation)."""
        rate = self._fixed
        if rate is not None and rate <= 0.0:
            return None
        step = self.host.hooks.kept_step(index)
        if step is None:
            return None
        key = (self.host.in_force().seed, step, index)
        return RowSlot(key, rate, self._selection, self._rows.place_rows)

    def weights(self) -> dict[str, torch.Tensor]:
        """Per branch name, the weights of its most recent selection (one per token row of its output: ``1 / p``
        where kept, 0 where its backward was skipped), for branches that made one."""
        rows = self._attached_rows()
        return {b.name: w for b, w in zip(self.host.branches, rows.last_weights, strict=True) if w is not None}

    def keep_shares(self) -> dict[str, float]:
        """Per branch name, the share of its token rows a kept branch's backward keeps now: ``1 - rate``, or under
        ``"auto"`` the share its readings chose (1 until it has one)."""
        rows = self._attached_rows()
        fixed = self._fixed
        shares = rows.auto_shares if fixed is None else [1.0 - fixed] * len(self.host.branches)
        return {b.name: share for b, share in zip(self.host.branches, shares, strict=True)}

    def _attached_rows(self) -> RowDropEngine:
        if self._part is None:
            raise RuntimeError(f"the {self.key} feature is not attached: pass it to dropbp.apply(..., features=[...])")
        return self._part

    def modules(self) -> list[nn.Module]:
        if self._part is None:
            return []
        branches = self.host.branches
        parts = [p for b in branches for p in b.parts]
        return parts + [linear.module for b in branches for linear in row_local_linears(b)[0]]

    def handles(self) -> list[RemovableHandle]:
        return [] if self._part is None else self._part.handles

    def state_dict(self) -> dict[str, Any] | None:
        return None if self._part is None or self._fixed is not None else self._part.auto_state()

    def check_state(self, state: Any) -> None:
        if state is not None and self._part is not None:
            check_token_shares(state, len(self.host.branches))

    def load_state_dict(self, state: Any) -> None:
        if state is not None and self._part is not None:
            self._part.load_auto_state(state)

    def logs(self) -> dict[str, float]:
        if self._part is None or self._fixed is not None:
            return {}
        shares = list(self.keep_shares().values())
        return {"token_keep_share": sum(shares) / len(shares), "token_keep_min": min(shares)}

    def __repr__(self) -> str:
        return f"TokenDrops(rate={self.rate!r}, selection={self._selection!r})"
