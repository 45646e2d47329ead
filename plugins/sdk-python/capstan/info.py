"""What a plugin declares: its parent kind, child and related kinds, finalizer, resync,
CRD, admission validation and conversion."""

import enum
from dataclasses import dataclass, field
from typing import List, Optional


@dataclass(frozen=True)
class KindRef:
    """A Kubernetes resource kind."""

    group: str
    """API group, empty for the core group."""
    version: str
    """Version within the group, such as ``v1``."""
    kind: str
    """CamelCase kind, such as ``StatefulSet``."""
    plural: str
    """Lower-case plural, as in URLs."""
    namespaced: bool = True
    """Whether objects of the kind live in a namespace."""

    @property
    def api_version(self) -> str:
        """``apiVersion`` as written in manifests."""
        return f"{self.group}/{self.version}" if self.group else self.version

    def matches(self, api_version: str, kind: str) -> bool:
        """Whether an object with this ``apiVersion`` and ``kind`` is of this kind."""
        return self.kind == kind and self.api_version == api_version


# The kinds plugins usually create, ready to declare.
SECRET = KindRef("", "v1", "Secret", "secrets")
CONFIG_MAP = KindRef("", "v1", "ConfigMap", "configmaps")
SERVICE = KindRef("", "v1", "Service", "services")
PERSISTENT_VOLUME_CLAIM = KindRef("", "v1", "PersistentVolumeClaim", "persistentvolumeclaims")
STATEFUL_SET = KindRef("apps", "v1", "StatefulSet", "statefulsets")
DEPLOYMENT = KindRef("apps", "v1", "Deployment", "deployments")
CRON_JOB = KindRef("batch", "v1", "CronJob", "cronjobs")
POD_DISRUPTION_BUDGET = KindRef("policy", "v1", "PodDisruptionBudget", "poddisruptionbudgets")
# Kinds plugins usually read as related objects.
POD = KindRef("", "v1", "Pod", "pods")
NAMESPACE = KindRef("", "v1", "Namespace", "namespaces", namespaced=False)


class FailurePolicy(enum.Enum):
    """What the API server does with a change when ``validate`` cannot answer (it
    trapped, ran out of time or memory, or no host serves the webhook)."""

    FAIL = "fail"
    """Refuse the change: nothing invalid gets in, but while no host answers, no parent
    of the kind can be created, changed or have its finalizer removed."""
    IGNORE = "ignore"
    """Store the change as if allowed; ``reconcile`` still sees it and can raise
    :class:`~capstan.Invalid`."""


@dataclass(frozen=True)
class PluginInfo:
    """A plugin's declaration. ``describe`` must return the same value every time."""

    name: str
    """Plugin name: lower-case letters, digits and ``-``."""
    version: str
    """The plugin's own version."""
    parent: KindRef
    """The kind it reconciles."""
    children: List[KindRef] = field(default_factory=list)
    """Every kind it may return as a child; the host refuses any other."""
    finalizer: bool = False
    """Whether the host adds a finalizer and calls ``finalize`` on deletion."""
    resync_seconds: Optional[int] = None
    """How often to reconcile an unchanged parent; None: the host's default."""
    crd: Optional[str] = None
    """The parent kind's CRD as JSON text (``capstan crd`` prints it)."""
    related: List[KindRef] = field(default_factory=list)
    """Kinds it reads but never writes: ``customize`` asks for objects of them, and the
    host passes those that exist to ``reconcile`` and ``finalize``. Not the parent's
    kind, nor a child kind."""
    validation: Optional[FailurePolicy] = None
    """When set, the host calls ``validate`` on each create and update of a parent (a
    validating admission webhook), with this policy for when it cannot answer. None:
    ``validate`` is never called."""
    conversion: bool = False
    """Whether the host serves the CRD's conversion webhook with ``convert`` (the CRD,
    ``crd``, must then be shipped and list the versions)."""

    def child_index(self, api_version: str, kind: str) -> Optional[int]:
        """Index of a declared child kind by ``apiVersion`` and ``kind``, or None."""
        return _index(self.children, api_version, kind)

    def related_index(self, api_version: str, kind: str) -> Optional[int]:
        """Index of a declared related kind by ``apiVersion`` and ``kind``, or None."""
        return _index(self.related, api_version, kind)


def _index(kinds: List[KindRef], api_version: str, kind: str) -> Optional[int]:
    for i, k in enumerate(kinds):
        if k.matches(api_version, kind):
            return i
    return None
