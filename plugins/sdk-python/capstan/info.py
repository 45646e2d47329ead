"""What a plugin declares: its parent kind, child kinds, finalizer, resync and CRD."""

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

    def child_index(self, api_version: str, kind: str) -> Optional[int]:
        """Index of a declared child kind by ``apiVersion`` and ``kind``, or None."""
        for i, k in enumerate(self.children):
            if k.matches(api_version, kind):
                return i
        return None
