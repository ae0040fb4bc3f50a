"""DropBP's options as config keys: ``dropbp_`` and an option's name, checked as a YAML file gives them.

:data:`DropBPArgs` is a pydantic model generated from :class:`dropbp.options.TrainerOptions` (every option, its
default and help): the keys of an axolotl config (``dropbp.integrations.axolotl``) and of a LLaMA-Factory YAML
(``dropbp.integrations.llamafactory``). Numbers and booleans are strict (YAML types them: ``true`` is no drop rate);
the options' own checks run with messages naming the keys.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from pydantic import BaseModel, Field, StrictBool, StrictFloat, StrictInt, create_model, model_validator

from dropbp.options import TrainerOptions, named_as, option_fields

__all__ = ["PREFIX", "DropBPArgs"]

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
    "token_drop_rate": StrictFloat | Literal["auto"],
}


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

    @model_validator(mode="after")
    def _dropbp_check(self) -> _DropBPArgsBase:
        """The options' own checks (:class:`dropbp.options.TrainerOptions`), the messages naming the config keys.

        The validators' names start with ``_dropbp`` because axolotl merges this class into its own
        config model, where a validator of the same name would replace one of axolotl's or be replaced.
        """
        try:
            with named_as(PREFIX):
                self.options()
        except TypeError as error:  # pydantic reports only ValueErrors
            raise ValueError(str(error)) from None
        return self

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> DropBPArgs:
        """The keys of an axolotl config (a ``DictDefault``, or any mapping) that belong to DropBP."""
        return cls.model_validate({key: cfg[key] for key in cls.model_fields if key in cfg})

    def attach_kwargs(self) -> dict[str, Any]:
        """The arguments of :func:`dropbp.integrations.hf.attach` that these keys stand for."""
        kwargs = {f.name: getattr(self, PREFIX + f.name) for f in option_fields(TrainerOptions)}
        if kwargs["calibrate_at"] is False:
            kwargs["calibrate_at"] = None
        return kwargs

    def options(self) -> TrainerOptions:
        """The options these keys stand for, checked."""
        return TrainerOptions(**self.attach_kwargs())


def _key(option: dataclasses.Field, annotation: Any) -> tuple[Any, Any]:
    kind = _YAML_OVERRIDES.get(option.name) or _yaml_type(annotation)
    if kind is None:
        raise TypeError(f"dropbp option {option.name} has a type YAML cannot write ({annotation}): give it a key type")
    return kind, Field(default=option.default, description=option.metadata["help"])


#: The plugin's config keys: ``dropbp_`` and the name of every option of :class:`dropbp.options.TrainerOptions`,
#: with its default and help, checked by its own checks when axolotl checks the config.
DropBPArgs = create_model(
    "DropBPArgs",
    __base__=_DropBPArgsBase,
    __module__=__name__,
    **{
        PREFIX + f.name: _key(f, hint)
        for f, hint in ((f, get_type_hints(TrainerOptions)[f.name]) for f in option_fields(TrainerOptions))
    },
)
