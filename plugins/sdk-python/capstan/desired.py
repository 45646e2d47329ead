"""What a reconcile returns: children, status, conditions, events, requeue."""

import copy
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from .errors import Retry
from .info import KindRef

Object = Dict[str, Any]

TRUE = "True"
FALSE = "False"
UNKNOWN = "Unknown"

NORMAL = "Normal"
WARNING = "Warning"

_U32_MAX = 2**32 - 1


@dataclass
class Condition:
    """A condition on the parent's status, as ``metav1.Condition`` (the host sets the
    times and ``observedGeneration``). One of type ``Ready`` replaces the host's own."""

    type: str
    status: str
    """``"True"``, ``"False"`` or ``"Unknown"``."""
    reason: str
    message: str


@dataclass
class Event:
    """An event the host posts on the parent. Never put secrets in the message."""

    type: str
    """``"Normal"`` or ``"Warning"``."""
    reason: str
    message: str


def _status_of(value: Any) -> str:
    if value is True:
        return TRUE
    if value is False:
        return FALSE
    if value in (TRUE, FALSE, UNKNOWN):
        return value
    raise ValueError(f"condition status {value!r} is not True, False or Unknown")


class Desired:
    """The desired state of one parent, built with chained calls::

        desired = Desired().child(config_map).status({"phase": "Running"})
    """

    def __init__(self) -> None:
        self.children: List[Object] = []
        """The child manifests added so far."""
        self.status_value: Optional[Object] = None
        """The status set so far; None leaves the plugin's status fields as they are."""
        self.conditions: List[Condition] = []
        self.events: List[Event] = []
        self.requeue_after_seconds: Optional[int] = None

    def child(self, manifest: Object) -> "Desired":
        """Adds a child manifest with ``apiVersion``, ``kind`` and ``metadata.name``, as
        for server-side apply. Leave the namespace and ownerReferences out: the host sets
        them. The manifest is copied, so later changes to it do not count."""
        if not isinstance(manifest, dict):
            raise Retry(f"a child must be a dict, not {type(manifest).__name__}")
        self.children.append(copy.deepcopy(manifest))
        return self

    def status(self, status: Object) -> "Desired":
        """Sets the plugin's status fields. The host adds ``observedGeneration`` and
        ``conditions``."""
        if not isinstance(status, dict):
            raise Retry(f"the status must be a dict, not {type(status).__name__}")
        self.status_value = copy.deepcopy(status)
        return self

    def condition(self, type_: str, status: Any, reason: str, message: str = "") -> "Desired":
        """Adds a condition; ``status`` is a bool or ``"True"``/``"False"``/``"Unknown"``."""
        self.conditions.append(Condition(type_, _status_of(status), reason, message))
        return self

    def event(self, reason: str, message: str, type_: str = NORMAL) -> "Desired":
        """Adds an event (Normal unless ``type_`` is ``WARNING``)."""
        if type_ not in (NORMAL, WARNING):
            raise ValueError(f"event type {type_!r} is not Normal or Warning")
        self.events.append(Event(type_, reason, message))
        return self

    def warning(self, reason: str, message: str) -> "Desired":
        """Adds a Warning event."""
        return self.event(reason, message, WARNING)

    def requeue_after(self, seconds: float) -> "Desired":
        """Reconcile again after ``seconds`` even if nothing changes (whole seconds, at
        least 1)."""
        self.requeue_after_seconds = max(1, min(_U32_MAX, int(seconds)))
        return self

    def child_named(self, kind: str, name: str) -> Optional[Object]:
        """The child manifest of ``kind`` named ``name`` added so far, if any."""
        for c in self.children:
            if c.get("kind") == kind and (c.get("metadata") or {}).get("name") == name:
                return c
        return None


@dataclass
class Finalized:
    """What ``finalize`` returns: done (the default, ``Finalized()``), pending
    (:meth:`pending`), or a teardown wave (:meth:`wave`)."""

    done: bool = True
    """True when cleanup is complete and the host may remove its finalizer. Ignored while
    ``deletes`` is not empty."""
    events: List[Event] = field(default_factory=list)
    requeue_after_seconds: Optional[int] = None
    """When not done, call again after this many seconds."""
    deletes: List[Tuple[str, str, str]] = field(default_factory=list)
    """The children this wave deletes: (apiVersion, kind, name)."""

    @staticmethod
    def pending(seconds: float) -> "Finalized":
        """Cleanup is under way; call again after ``seconds``."""
        return Finalized(False, [], max(1, min(_U32_MAX, int(seconds))))

    @staticmethod
    def wave() -> "Finalized":
        """A teardown wave: the host deletes the children named with :meth:`delete`
        (only those this parent controls), waits until they are gone, and calls
        ``finalize`` again. Return the next wave from there, or ``Finalized()`` when
        nothing is left to order. A wave that names no observed child is over at once.
        Children never named go with the parent, through their ownerReference."""
        return Finalized(False)

    def delete(self, kind: KindRef, name: str) -> "Finalized":
        """Names an observed child of a declared child kind to delete in this wave, such
        as ``Finalized.wave().delete(STATEFUL_SET, ctx.name)``."""
        if not isinstance(kind, KindRef):
            raise TypeError(f"Finalized.delete needs a KindRef, not {type(kind).__name__}")
        return self.delete_raw(kind.api_version, kind.kind, name)

    def delete_raw(self, api_version: str, kind: str, name: str) -> "Finalized":
        """Names a child to delete in this wave by ``apiVersion``, ``kind`` and name."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"a child to delete needs a non-empty name string, not {name!r}")
        self.deletes.append((api_version, kind, name))
        return self

    def event(self, reason: str, message: str, type_: str = NORMAL) -> "Finalized":
        """Adds an event."""
        if type_ not in (NORMAL, WARNING):
            raise ValueError(f"event type {type_!r} is not Normal or Warning")
        self.events.append(Event(type_, reason, message))
        return self

    def warning(self, reason: str, message: str) -> "Finalized":
        """Adds a Warning event."""
        return self.event(reason, message, WARNING)
