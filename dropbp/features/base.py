"""The protocol between the controller and a feature: what a capability beyond the paper's DropBP implements.

A feature (the noise scale, the chunked loss, token drops) is given to ``dropbp.apply(..., features=[...])``. It owns
its options (its constructor's arguments, checked there), its ``"auto"`` / ``None`` resolution, its part of the
controller's ``state_dict`` (under its :attr:`Feature.key`), its Trainer log and its removal. The controller calls it
(through :class:`dropbp.features.attached.AttachedFeatures`) and nothing else: :meth:`~Feature.check` before anything
is attached (a refusal leaves the model as it was), :meth:`~Feature.attach` once the core is in place (a feature
reaches the core through :class:`dropbp.features.host.Host` only), its state and log when asked, and
:meth:`~Feature.remove` at ``ctl.remove()`` or when ``ctl.replace_options(features=...)`` leaves it out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from torch import nn
from torch.utils.hooks import RemovableHandle

if TYPE_CHECKING:
    from dropbp.features.host import Host

__all__ = ["Feature", "dropped_fill", "feature_class", "feature_classes", "register_feature"]


class Feature:
    """A capability attached to one controller; subclasses override what they use (each default does nothing).

    A feature object serves one controller: :meth:`attach` refuses a second one.
    """

    #: Its name: the controller's ``state_dict`` key, its entry in ``ctl.features`` and the prefix of its Trainer logs.
    key: ClassVar[str] = ""
    #: Whether ``memory_bound="auto"`` turns the bound on with it (what it buys is memory).
    bounds_memory: ClassVar[bool] = False
    #: The options of an earlier release this feature replaces, each with how to write it now (an old spelling given
    #: to ``apply`` or a setter is refused with this).
    replaces: ClassVar[dict[str, str]] = {}
    #: Whether it decides which patterns are drawn (a policy extension point): its settings are then its state, and a
    #: state saved with it loads only where it is attached with the same settings (the controller checks).
    needed_to_resume: ClassVar[bool] = False
    #: Extension points of the policy (:mod:`dropbp.policy.plugins`): how the rates rise over a run, and a sampler
    #: in place of the shape's; None: the feature leaves them alone.
    rise: Any = None
    pattern_draw: Any = None
    #: Whether it chooses the rate of ``drop_rate="auto"`` (:meth:`choose_rate`); the first registered such class is
    #: added where ``"auto"`` is given without one (the noise scale).
    chooses_rate: ClassVar[bool] = False
    #: An extension point of the dropped branches' gradients: how they get one before the optimizer steps (``"zero"``
    #: or ``"reuse"``; None: they get none, the paper's), read by a framework's guard (:func:`dropped_fill`).
    dropped_fill: str | None = None

    def __init__(self) -> None:
        self._host: Host | None = None
        #: What :meth:`attach` put on the model (an object with ``remove()``), taken off by :meth:`remove`.
        self._part: Any = None

    @property
    def host(self) -> Host:
        """What this feature may use of the controller it is attached to (:class:`dropbp.features.host.Host`)."""
        if self._host is None:
            raise RuntimeError(f"the {self.key} feature is not attached: pass it to dropbp.apply(..., features=[...])")
        return self._host

    @property
    def attached(self) -> bool:
        return self._host is not None

    @classmethod
    def from_config(cls, value: object) -> Feature | None:
        """The feature a config value stands for (a config file's key, a tool's arm): ``True`` its defaults, a mapping
        its constructor's arguments (:meth:`config`'s form), ``False`` or ``None`` none. Its own checks run."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, Mapping):
            return cls(**value)
        raise TypeError(f"{cls.key} takes true, false or a mapping of its arguments, got {value!r:.80}")

    @classmethod
    def from_flat(cls, settings: dict[str, Any]) -> Feature | None:
        """The feature that 0.3's flat settings in ``settings`` stand for (the results tables name their arms so:
        :mod:`dropbp.tools.arms`), taking its names out of ``settings``; None where they ask for none (by default: it
        has no flat names)."""
        return None

    def config(self) -> dict[str, Any]:
        """Its settings as plain values (a mapping :meth:`from_config` takes back to an equal feature)."""
        return {}

    @classmethod
    def migrate_state(cls, state: dict[str, Any], attached: Feature | None) -> dict[str, Any]:
        """A controller state of an earlier version with this feature's settings of that release taken out (a copy
        where changed): a ValueError naming the way now where one that mattered is not what ``attached`` (the
        feature of this key given now, or None) does. By default: as it is."""
        return state

    def choose_rate(self, shape: Any, flops: Sequence[float]) -> float:
        """Where :attr:`chooses_rate`: the drop rate ``"auto"`` stands for now, among those the drop ``shape`` reaches
        over branches of these costs."""
        raise NotImplementedError(f"{type(self).__name__} does not choose a drop rate")

    def check(self, model: nn.Module, framework: bool) -> None:
        """Raise if this feature cannot run on ``model`` (``framework``: a DeepSpeed engine holds its gradients),
        before the controller attaches anything."""

    def attach(self, host: Host) -> None:
        """Put the feature on the model; the core's hooks are in place. Subclasses call this first."""
        if self._host is not None:
            raise ValueError(f"this {type(self).__name__} is attached to another controller: make one per model")
        self._host = host

    def modules(self) -> list[nn.Module]:
        """The modules it hooks or patches (copies and pickles of them come out clean)."""
        return []

    def handles(self) -> list[RemovableHandle]:
        """Its hooks' handles now (left out of copies and pickles)."""
        return []

    def state_dict(self) -> dict[str, Any] | None:
        """Its part of the controller's state (None: nothing to resume); by default its settings where it decides the
        patterns (:attr:`needed_to_resume`)."""
        return self.config() if self.needed_to_resume else None

    def check_state(self, state: Any) -> None:
        """Raise if ``state`` (:meth:`state_dict` output read back) cannot be loaded; change nothing. By default, where
        it decides the patterns: its settings must be the saved ones."""
        if self.needed_to_resume and state != self.config():
            raise ValueError(
                f"state[{self.key!r}] was saved with {type(self).__name__} settings {state!r:.80}, this one has "
                f"{self.config()}: give the saved settings to resume the same patterns"
            )

    def load_state_dict(self, state: Any) -> None:
        """Restore :meth:`state_dict` output, already checked by :meth:`check_state`."""

    def logs(self) -> dict[str, float]:
        """What the Trainer callback logs of it at each logging step (keys without the ``dropbp/`` prefix)."""
        return {}

    def remove(self) -> None:
        """Take the feature off the model (the controller's ``remove``)."""
        if self._part is not None:
            self._part.remove()
            self._part = None
        self._host = None


_REGISTRY: dict[str, type[Feature]] = {}


def register_feature(cls: type[Feature]) -> type[Feature]:
    """Make ``cls`` a feature config files and the Trainer integration can name by its :attr:`Feature.key` (the key
    ``dropbp_<key>`` of an axolotl or LLaMA-Factory config); returns it, so it can decorate the class. A key already
    registered to another class is refused."""
    if not (isinstance(cls, type) and issubclass(cls, Feature)):
        raise TypeError(f"register_feature takes a dropbp.Feature subclass, got {cls!r:.80}")
    if not cls.key or not cls.key.isidentifier():
        raise ValueError(f"{cls.__name__}.key must be a name (letters, digits, _), got {cls.key!r}")
    known = _REGISTRY.get(cls.key)
    if known is not None and known is not cls and known.__qualname__ != cls.__qualname__:
        raise ValueError(f"the feature key {cls.key!r} is taken by {known.__name__}; give {cls.__name__} another key")
    _REGISTRY[cls.key] = cls
    return cls


def feature_classes() -> dict[str, type[Feature]]:
    """The registered features by key, in registration order."""
    return dict(_REGISTRY)


def feature_class(key: str) -> type[Feature]:
    """The registered feature of this key (a KeyError naming those registered where none is)."""
    try:
        return _REGISTRY[key]
    except KeyError:
        raise KeyError(f"no dropbp feature has the key {key!r}; registered: {', '.join(_REGISTRY)}") from None


def dropped_fill(features: Sequence[Feature]) -> str | None:
    """How dropped branches' parameters get a gradient with these features (:attr:`Feature.dropped_fill`), or None."""
    return next((f.dropped_fill for f in features if f.dropped_fill is not None), None)
