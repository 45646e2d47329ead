"""Write Capstan plugins in Python: Kubernetes reconcilers that run as sandboxed
WebAssembly components (``capstan:plugin@0.1.0``, built with componentize-py).

A plugin reconciles one custom resource kind. It is a pure function of what the host
observed - the parent and the children it controls, here plain dicts - and returns the
children it wants, its status, conditions and events in a :class:`Desired`. The host does
every API call. See docs/plugins.md, "Write a plugin in Python".
"""

from . import log, random
from .context import Context
from .desired import FALSE, NORMAL, TRUE, UNKNOWN, WARNING, Condition, Desired, Event, Finalized
from .errors import Invalid, PluginError, Retry
from .info import (
    CONFIG_MAP,
    CRON_JOB,
    DEPLOYMENT,
    PERSISTENT_VOLUME_CLAIM,
    POD_DISRUPTION_BUDGET,
    SECRET,
    SERVICE,
    STATEFUL_SET,
    KindRef,
    PluginInfo,
)
from .plugin import Plugin

__all__ = [
    "CONFIG_MAP",
    "CRON_JOB",
    "DEPLOYMENT",
    "FALSE",
    "NORMAL",
    "PERSISTENT_VOLUME_CLAIM",
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
    "Finalized",
    "Invalid",
    "KindRef",
    "Plugin",
    "PluginError",
    "PluginInfo",
    "Retry",
    "log",
    "random",
]
