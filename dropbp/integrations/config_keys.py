"""DropBP's options as config keys: ``dropbp_`` and an option's name, checked as a YAML file gives them.

:data:`DropBPArgs` is a pydantic model generated from :class:`dropbp.options.TrainerOptions` (every option, its
default and help; ``features`` as one key per feature, :data:`FEATURE_KEYS`, which build the same feature objects as
``features=[...]``): the keys of an axolotl config (``dropbp.integrations.axolotl``) and of a LLaMA-Factory YAML
(``dropbp.integrations.llamafactory``). Numbers and booleans are strict (YAML types them: ``true`` is no drop rate);
the options' own checks run with messages naming the keys; an experimental option's key says where it went.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping, Sequence
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from pydantic import BaseModel, Field, StrictBool, StrictFloat, StrictInt, create_model, model_validator

import dropbp.experimental  # noqa: F401  (registers its features: TokenDrops)
from dropbp.features.base import Feature, feature_classes
from dropbp.options import INTERNAL, TrainerOptions, named_as, option_fields

__all__ = ["MOVED_KEYS", "PREFIX", "dropbp_args", "feature_key", "moved_key"]

#: What goes before each option's name to make its config key.
PREFIX = "dropbp_"


def _yaml_type(annotation: Any) -> Any:
    """The pydantic type of a config key for an option of this type: strict numbers and booleans (YAML gives
    them their own types, and a lax model would read ``true`` as a drop rate of 1.0), lists for sequences;
    what YAML cannot write (a ``Backend`` instance) is left out of a union."""
    if annotation is float:
        return StrictFloat
    if annotation is int:
        return StrictInt
    if annotation is bool:
        return StrictBool
    if annotation in (str, type(None)):
        return annotation
    if get_origin(annotation) in (Sequence, list, tuple):
        return list[get_args(annotation)[0]]
    if get_origin(annotation) in (Union, UnionType):
        kept = [_yaml_type(a) for a in get_args(annotation)]
        kept = [k for k in kept if k is not None or type(None) in get_args(annotation)]
        return Union[tuple(k if k is not None else type(None) for k in kept)]  # noqa: UP007
    return None


# The keys whose YAML form differs from the Python one: ``dropbp_calibrate_at: false`` means never.
_YAML_OVERRIDES: dict[str, Any] = {
    "calibrate_at": StrictFloat | Literal["auto", False],
    "drop_rate": StrictFloat | Literal["auto"],
}


#: 0.3's keys for features, each now one key per feature (:func:`feature_key`), and how to write it.
MOVED_KEYS = {
    "dropbp_measure_noise_scale": "dropbp_noise_scale: true",
    "dropbp_token_drop_rate": "dropbp_token_drops: 0.3 (or a mapping: {rate: 0.3, selection: gradient})",
    "dropbp_token_selection": "dropbp_token_drops: {rate: 0.3, selection: random}",
}


def feature_key(cls: type[Feature]) -> str:
    """The config key of a registered feature: ``dropbp_`` and its :attr:`~dropbp.features.base.Feature.key`. Its value
    is what :meth:`~dropbp.features.base.Feature.from_config` takes: ``true`` (its defaults), a mapping of its
    arguments, ``false`` or null (none), or what the feature's own ``from_config`` adds (a number)."""
    return PREFIX + cls.key


def moved_key(key: str) -> str | None:
    """What to write now for a config key of an earlier release, as a sentence naming the key; None where ``key`` was
    none: 0.3's feature keys (:data:`MOVED_KEYS`), its experimental options' (each now a feature's key) and its internal
    ones (``dropbp_seq_len``)."""
    name = key.removeprefix(PREFIX)
    owner = next((cls for cls in feature_classes().values() if name in cls.replaces), None)
    if key in MOVED_KEYS:
        return f"{key} is one key per feature since dropbp 0.4: write {MOVED_KEYS[key]}"
    if not key.startswith(PREFIX):
        return None
    if name in INTERNAL:
        return f"{key} is no config key since dropbp 0.4: {INTERNAL[name]}"
    if owner is not None:
        return (
            f"{key}: measured and not better, it is the feature {owner.__name__} since dropbp 0.4: write "
            f"{feature_key(owner)}: true, or a mapping of its arguments ({cls_args(owner)})"
        )
    return None


def cls_args(cls: type[Feature]) -> str:
    """A feature class's constructor arguments, as a config mapping names them."""
    return ", ".join(name for name in inspect.signature(cls).parameters) or "none"


#: The YAML type of a feature's key: the feature's ``from_config`` checks the value itself.
_FEATURE_VALUE = StrictBool | StrictInt | StrictFloat | str | dict[str, Any] | None


class _DropBPArgsBase(BaseModel):
    """What :class:`DropBPArgs` adds to its generated fields: the checks, and the way back to the options."""

    @model_validator(mode="before")
    @classmethod
    def _dropbp_null_calibrate_at_means_never(cls, data: Any) -> Any:
        """An explicit ``dropbp_calibrate_at: null`` becomes ``False``.

        axolotl drops null keys when it stores the checked config, after which a null could not be
        told apart from a key left out (which means ``auto``).
        """
        if isinstance(data, Mapping) and "dropbp_calibrate_at" in data and data["dropbp_calibrate_at"] is None:
            data = {**data, "dropbp_calibrate_at": False}
        return data

    @model_validator(mode="before")
    @classmethod
    def _dropbp_experimental_keys_moved(cls, data: Any) -> Any:
        """An earlier release's key (``dropbp_stratify``, ``dropbp_token_drop_rate``) is refused, saying the key now
        (:func:`moved_key`), not ignored."""
        for key in sorted(data) if isinstance(data, Mapping) else ():
            said = moved_key(key)
            if said is not None:
                raise ValueError(said)
        return data

    @model_validator(mode="after")
    def _dropbp_check(self) -> _DropBPArgsBase:
        """The options' own checks (:class:`dropbp.options.TrainerOptions`), the messages naming the config keys.

        The validators' names start with ``_dropbp`` because axolotl merges this class into its own
        config model, where a validator of the same name would replace one of axolotl's or be replaced.
        """
        try:
            with named_as(PREFIX + "{}"):
                self.options()
        except TypeError as error:  # pydantic reports only ValueErrors
            raise ValueError(str(error)) from None
        return self

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> _DropBPArgsBase:
        """The keys of an axolotl config (a ``DictDefault``, or any mapping) that belong to DropBP."""
        return cls.model_validate({key: cfg[key] for key in cls.model_fields if key in cfg})

    def attach_kwargs(self) -> dict[str, Any]:
        """The arguments of :func:`dropbp.integrations.hf.attach` that these keys stand for."""
        kwargs = {f.name: getattr(self, PREFIX + f.name) for f in option_fields(TrainerOptions) if f.name != "features"}
        if kwargs["calibrate_at"] is False:
            kwargs["calibrate_at"] = None
        features = []
        for cls in feature_classes().values():
            key = feature_key(cls)
            if key not in type(self).model_fields:
                continue  # registered after these keys were read
            try:
                features.append(cls.from_config(getattr(self, key)))
            except (ValueError, TypeError) as error:  # the feature's own check, named by its key
                raise type(error)(f"{key}: {error}") from None
        kwargs["features"] = tuple(f for f in features if f is not None)
        return kwargs

    def options(self) -> TrainerOptions:
        """The options these keys stand for, checked."""
        return TrainerOptions(**self.attach_kwargs())


def _key(option: dataclasses.Field, annotation: Any) -> tuple[Any, Any]:
    kind = _YAML_OVERRIDES.get(option.name) or _yaml_type(annotation)
    if kind is None:
        raise TypeError(f"dropbp option {option.name} has a type YAML cannot write ({annotation}): give it a key type")
    return kind, Field(default=option.default, description=option.metadata["help"])


def _build() -> type[_DropBPArgsBase]:
    return create_model(
        "DropBPArgs",
        __base__=_DropBPArgsBase,
        __module__=__name__,
        **{
            PREFIX + f.name: _key(f, hint)
            for f, hint in ((f, get_type_hints(TrainerOptions)[f.name]) for f in option_fields(TrainerOptions))
            if f.name != "features"
        },
        **{
            feature_key(cls): (_FEATURE_VALUE, Field(default=False, description=(cls.__doc__ or "").split("\n")[0]))
            for cls in feature_classes().values()
        },
    )


_BUILT: dict[tuple[type[Feature], ...], type[_DropBPArgsBase]] = {}


def dropbp_args() -> type[_DropBPArgsBase]:
    """The config keys as a pydantic model (axolotl merges it into its config model): ``dropbp_`` and the name of
    every option of :class:`dropbp.options.TrainerOptions`, with its default and help, checked by its own checks, and
    one key per registered feature (:func:`feature_key`); made again when a feature is registered."""
    registered = tuple(feature_classes().values())
    if registered not in _BUILT:
        _BUILT[registered] = _build()
    return _BUILT[registered]


def __getattr__(name: str) -> Any:
    """``DropBPArgs``: :func:`dropbp_args` now (the registered features' keys included)."""
    if name == "DropBPArgs":
        return dropbp_args()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
