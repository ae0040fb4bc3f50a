"""The controller's checkpoint state (``ctl.state_dict()``): its fields, checked before anything is restored.

A state read back from a file may have been edited, written by another tool or truncated. Its structure is checked
here (every key there, none unknown: a misspelt ``warmup_step`` is refused rather than ignored; the version, the
branches, the rates, the step); each setting is checked once, by the options' own checks, its message naming the
state's field (:func:`state_settings`); each feature checks its own entry. Nothing is half-applied and nothing is
silently lost. A state of an earlier version is migrated first (:func:`migrate`).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from dropbp.checks import check_bool, check_int, check_number, check_sequence, is_auto
from dropbp.features.base import Feature, feature_classes
from dropbp.options import named_as
from dropbp.policy.windows import Windows

__all__ = ["STATE_VERSION", "check_state", "migrate", "state_settings"]

#: 2 since dropbp 0.4 (1: 0.2 and 0.3, whose experimental settings the features that replace them migrate).
STATE_VERSION = 2

#: The keys of a state that are settings of the options (the others: version, branches, rates, step and
#: rates_follow_drop_rate).
POLICY_STATE = (
    "drop_rate",
    "seed",
    "max_patterns",
    "warmup_steps",
    "pattern",
    "total_steps",
)

#: Keys of 0.2's states that 0.3 keeps elsewhere, and where.
MOVED_STATE = {
    "token_shares": "0.2's automatic token shares: 0.3 keeps them under 'token_drops' (dropbp.experimental.TokenDrops)"
}

#: The keys of a state (every one required: no release wrote states with fewer).
REQUIRED = ("version", "branches", "rates", "step", *POLICY_STATE, "rates_follow_drop_rate")
#: Keys only some states have: ``windows`` where the run's optimizer-step windows are set. Each registered feature's
#: key may hold its state too (:func:`dropbp.features.base.feature_classes`), which the feature checks itself
#: (:meth:`dropbp.features.base.Feature.check_state`) where it is attached.
OPTIONAL = ("windows",)


def _field(name: str) -> str:
    return f"state[{name!r}]"


def _with_hint(key: object) -> str:
    close = difflib.get_close_matches(str(key), REQUIRED + OPTIONAL + tuple(feature_classes()), 1)
    return f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key)


def migrate(state: dict[str, Any], attached: dict[str, Feature]) -> dict[str, Any]:
    """A state of an earlier version as this version's (a copy): each registered feature takes out the settings of an
    earlier release it replaces (:meth:`dropbp.features.base.Feature.migrate_state`, given the feature attached
    under its key, or None), refusing to drop one that mattered. A state of this version is returned as it is."""
    if not isinstance(state, dict) or state.get("version") != 1:
        return state
    for cls in feature_classes().values():
        state = cls.migrate_state(state, attached.get(cls.key))
    return {**state, "version": STATE_VERSION}


def check_state(state: object, feature_keys: tuple[str, ...] = (), names: list[str] | None = None) -> dict[str, Any]:
    """``state`` if it is a complete, well-typed controller state of this version (:func:`migrate` first for an
    earlier one; ``feature_keys``: the attached features' keys, whose entries their features check), saved for the
    branches ``names`` where given; else a ``TypeError`` or ``ValueError`` naming the field. (Whether its rates suit
    this model is checked where they are used.)"""
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict from state_dict(), got {type(state).__name__}")
    missing = set(REQUIRED) - set(state)
    if missing:
        raise ValueError(f"state is missing keys {sorted(missing)}; pass the dict from state_dict()")
    for key in set(state) & set(MOVED_STATE):
        raise ValueError(f"state[{key!r}] is {MOVED_STATE[key]}")
    unknown = sorted(set(state) - set(REQUIRED) - set(OPTIONAL) - set(feature_keys) - set(feature_classes()), key=str)
    for key, cls in feature_classes().items():
        if cls.needed_to_resume and key in state and key not in feature_keys:
            raise ValueError(
                f"state was saved with {cls.__name__} ({state[key]!r:.80}), which decides the patterns: pass it in "
                f"features (dropbp.apply(..., features=[{cls.__name__}(...)])) to resume them"
            )
    if unknown:
        hints = [_with_hint(key) for key in unknown]
        raise ValueError(
            f"state has keys dropbp does not know: {', '.join(hints)}; pass the dict from state_dict() unchanged"
        )
    version = check_int(_field("version"), state["version"], 0)
    if version != STATE_VERSION:
        raise ValueError(
            f"state version {version} is not this dropbp's ({STATE_VERSION}): it was written by another version; "
            "resume with the dropbp that saved it"
        )
    branches = state["branches"]
    if not isinstance(branches, (list, tuple)) or not all(isinstance(b, str) for b in branches):
        raise TypeError(f"{_field('branches')} must be a list of branch names, got {branches!r:.80}")
    if names is not None and list(branches) != names:
        raise ValueError(
            f"state was saved for different branches: saved {len(branches)} starting {list(branches)[:2]}, "
            f"this model has {len(names)} starting {names[:2]}"
        )
    for i, rate in enumerate(check_sequence(_field("rates"), state["rates"])):
        check_number(f"state['rates'][{i}]", rate)
    if is_auto(state["drop_rate"]):  # "auto" resumes from the state of the feature that chooses its rate
        chooser = next(key for key, cls in feature_classes().items() if cls.chooses_rate)
        if chooser not in state:
            raise ValueError(f"{_field('drop_rate')} is 'auto' but the state has no {chooser!r}; pass state_dict()'s")
    check_int(_field("step"), state["step"], 0)
    Windows.of(state.get("windows"))
    check_bool(_field("rates_follow_drop_rate"), state["rates_follow_drop_rate"])
    return state


@contextmanager
def state_settings(state: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The options a structurally checked ``state`` sets (:data:`POLICY_STATE`), for ``dataclasses.replace`` inside the
    block: the options' own checks, the one validation of each setting, name the state's fields
    (``state['seed'] must be an int >= 0``)."""
    with named_as("state[{!r}]"):
        yield {name: state[name] for name in POLICY_STATE}

