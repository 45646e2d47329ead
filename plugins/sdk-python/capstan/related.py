"""What ``customize`` answers: which related objects one parent needs."""

from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Tuple, Union

from .info import KindRef

Labels = Union[Mapping[str, str], Iterable[Tuple[str, str]]]


@dataclass(frozen=True)
class Related:
    """A request for objects of one declared related kind: the object of a name, or
    every object of the parent's namespace that carries some labels. Make one with
    :meth:`named` or :meth:`labelled`."""

    kind: KindRef
    """A kind of ``PluginInfo.related``."""
    name: Optional[str] = None
    """The object of this name (in the parent's namespace for a namespaced kind)."""
    labels: Optional[Tuple[Tuple[str, str], ...]] = None
    """Every object of the parent's namespace that carries all these (key, value)
    labels, Kubernetes' ``matchLabels``; an empty tuple selects every object of the
    namespace. Namespaced kinds only."""

    @staticmethod
    def named(kind: KindRef, name: str) -> "Related":
        """The object of ``kind`` named ``name``, such as
        ``Related.named(CONFIG_MAP, ctx.spec["config"])``."""
        if not isinstance(kind, KindRef):
            raise TypeError(f"Related.named needs a KindRef, not {type(kind).__name__}")
        if not isinstance(name, str) or not name:
            raise TypeError(f"Related.named needs a non-empty name string, not {name!r}")
        return Related(kind, name=name)

    @staticmethod
    def labelled(kind: KindRef, labels: Labels) -> "Related":
        """Every object of ``kind`` in the parent's namespace that carries all of
        ``labels`` (a dict, or (key, value) pairs), such as the Pods of a StatefulSet:
        ``Related.labelled(POD, {"app.kubernetes.io/instance": ctx.name})``."""
        if not isinstance(kind, KindRef):
            raise TypeError(f"Related.labelled needs a KindRef, not {type(kind).__name__}")
        pairs = []
        for pair in labels.items() if isinstance(labels, Mapping) else labels:
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(isinstance(p, str) for p in pair)):
                raise TypeError(f"Related.labelled needs string label keys and values, not {pair!r}")
            pairs.append((pair[0], pair[1]))
        return Related(kind, labels=tuple(pairs))
