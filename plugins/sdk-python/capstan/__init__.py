"""Write Capstan plugins in Python: Kubernetes reconcilers that run as sandboxed
WebAssembly components (``capstan:plugin@0.2.0``, built with componentize-py).

A plugin reconciles one custom resource kind. It is a pure function of what the host
observed - the parent, the children it controls and the related objects it asked for in
``customize``, here plain dicts - and returns the children it wants, its status,
conditions and events in a :class:`Desired`. The host does every API call. A plugin may
also tear its children down in order (:meth:`Finalized.wave`), check changes at admission
(``validate``) and convert between versions of its CRD (``convert``). See
docs/plugins.md, "Write a plugin in Python".
"""

from . import log, random
from .context import Context
from .desired import FALSE, NORMAL, TRUE, UNKNOWN, WARNING, Condition, Desired, Event, Finalized
from .errors import Invalid, PluginError, Retry
from .info import (
    CONFIG_MAP,
    CRON_JOB,
    DEPLOYMENT,
    NAMESPACE,
    PERSISTENT_VOLUME_CLAIM,
    POD,
    POD_DISRUPTION_BUDGET,
    SECRET,
    SERVICE,
    STATEFUL_SET,
    FailurePolicy,
    KindRef,
    PluginInfo,
)
from .plugin import Plugin
from .related import Related

__all__ = [
    "CONFIG_MAP",
    "CRON_JOB",
    "DEPLOYMENT",
    "FALSE",
    "NAMESPACE",
    "NORMAL",
    "PERSISTENT_VOLUME_CLAIM",
    "POD",
    "POD_DISRUPTION_BUDGET",
    "SECRET",
    "SERVICE",
    "STATEFUL_SET",
    "TRUE",
    "UNKNOWN",
    "WARNING",
    "Condition",
    "Context",
    "Desired",
    "Event",
    "FailurePolicy",
    "Finalized",
    "Invalid",
    "KindRef",
    "Plugin",
    "PluginError",
    "PluginInfo",
    "Related",
    "Retry",
    "log",
    "random",
]
