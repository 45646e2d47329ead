"""What a reconcile sees: the parent, the children it controls and the related objects
``customize`` asked for, as plain dicts."""

from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

from .errors import Invalid
from .info import KindRef, PluginInfo

Object = Dict[str, Any]


class Context:
    """The observed state of one parent, as the host read it from the API server.

    Objects are the JSON the API server returned, as ``dict``; change copies, not them.
    """

    def __init__(
        self,
        info: PluginInfo,
        parent: Object,
        children: List[Tuple[int, Object]],
        related: Iterable[Tuple[int, Object]] = (),
    ):
        """``children`` and ``related`` pair each object with the index of its kind in
        ``info.children`` and ``info.related``."""
        self.info = info
        """What the plugin declared."""
        self.parent = parent
        """The parent object (metadata, spec, status)."""
        self._children = children
        self._related = list(related)

    @property
    def metadata(self) -> Object:
        """The parent's ``metadata``."""
        return self.parent.get("metadata") or {}

    @property
    def name(self) -> str:
        """The parent's name."""
        return self.metadata.get("name", "")

    @property
    def namespace(self) -> str:
        """The parent's namespace (empty for a cluster-scoped parent)."""
        return self.metadata.get("namespace", "")

    @property
    def uid(self) -> str:
        """The parent's UID."""
        return self.metadata.get("uid", "")

    @property
    def generation(self) -> int:
        """The parent's ``metadata.generation``."""
        return int(self.metadata.get("generation") or 0)

    @property
    def is_deleting(self) -> bool:
        """Whether the parent is being deleted."""
        return "deletionTimestamp" in self.metadata

    @property
    def spec(self) -> Object:
        """The parent's spec (an empty dict when it has none). A spec that is not an
        object is :class:`Invalid`."""
        spec = self.parent.get("spec")
        if spec is None:
            return {}
        if not isinstance(spec, dict):
            raise Invalid("spec must be an object")
        return spec

    @property
    def status(self) -> Object:
        """The parent's current status (an empty dict before the first write)."""
        status = self.parent.get("status")
        return status if isinstance(status, dict) else {}

    def condition(self, type_: str) -> Optional[Object]:
        """The parent's current condition of ``type_``, if any."""
        for c in self.status.get("conditions") or []:
            if isinstance(c, dict) and c.get("type") == type_:
                return c
        return None

    def children(self, kind: KindRef) -> List[Object]:
        """Observed children of a declared kind, such as ``ctx.children(SECRET)``."""
        return list(self._of(kind))

    def child(self, kind: KindRef, name: str) -> Optional[Object]:
        """The observed child of ``kind`` named ``name``, if any."""
        for c in self._of(kind):
            if (c.get("metadata") or {}).get("name") == name:
                return c
        return None

    def all_children(self) -> List[Tuple[KindRef, Object]]:
        """Every observed child with its declared kind."""
        return [(self.info.children[i], c) for i, c in self._children if i < len(self.info.children)]

    def related(self, kind: KindRef) -> List[Object]:
        """The objects of a declared related kind that ``customize`` asked for and that
        exist, such as ``ctx.related(CONFIG_MAP)``. Empty in ``customize`` itself."""
        return list(self._related_of(kind))

    def related_named(self, kind: KindRef, name: str) -> Optional[Object]:
        """The related object of ``kind`` named ``name``, if ``customize`` asked for it
        and it exists."""
        for o in self._related_of(kind):
            if (o.get("metadata") or {}).get("name") == name:
                return o
        return None

    def all_related(self) -> List[Tuple[KindRef, Object]]:
        """Every related object with its declared kind."""
        return [(self.info.related[i], o) for i, o in self._related if i < len(self.info.related)]

    def _of(self, kind: KindRef) -> Iterator[Object]:
        index = self.info.child_index(kind.api_version, kind.kind)
        if index is None:
            raise ValueError(f"{kind.kind}.{kind.api_version} is not a declared child kind")
        return (c for i, c in self._children if i == index)

    def _related_of(self, kind: KindRef) -> Iterator[Object]:
        index = self.info.related_index(kind.api_version, kind.kind)
        if index is None:
            raise ValueError(f"{kind.kind}.{kind.api_version} is not a declared related kind")
        return (o for i, o in self._related if i == index)
