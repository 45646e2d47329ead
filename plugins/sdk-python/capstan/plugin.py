"""The plugin interface, and the calls into it shared by the sandbox and the test harness."""

import json
import traceback
from typing import Any, Dict, List, Tuple

from . import log
from .context import Context
from .desired import Desired, Finalized
from .errors import PluginError, Retry
from .info import PluginInfo


class Plugin:
    """A Capstan plugin. Subclass it, then export an instance from the component's
    ``app.py`` with ``Reconciler = capstan.component.export(MyPlugin())``."""

    def describe(self) -> PluginInfo:
        """What the plugin reconciles and may create. Must return the same value every
        time (the SDK calls it once, when the component is built)."""
        raise NotImplementedError

    def reconcile(self, ctx: Context) -> Desired:
        """Computes the desired state from the observed one. Must be idempotent: generate
        passwords and the like only when they are absent from what was observed. Raise
        :class:`~capstan.Invalid` for a wrong spec, :class:`~capstan.Retry` for a
        transient failure."""
        raise NotImplementedError

    def finalize(self, ctx: Context) -> Finalized:
        """Cleans up before the parent is deleted; called only with
        ``PluginInfo.finalizer``. The default reports done at once."""
        return Finalized()


def observe(info: PluginInfo, parent: str, children: List[Tuple[int, str]]) -> Context:
    """A :class:`Context` from the JSON texts the host passes."""
    try:
        parent_obj = json.loads(parent)
        objs = [(int(i), json.loads(text)) for i, text in children]
    except ValueError as e:
        raise Retry(f"host sent an object that is not JSON: {e}") from None
    return Context(info, parent_obj, objs)


def guarded(call, *args):
    """Runs a plugin method; an exception other than Invalid or Retry is a bug in the
    plugin: its traceback goes to the log at error level and the host gets a Retry that
    names it (the host backs off, and reports it on the parent)."""
    try:
        return call(*args)
    except PluginError:
        raise
    except Exception as e:
        log.error("reconcile raised " + "".join(traceback.format_exception(e)).rstrip())
        raise Retry(f"the plugin raised {type(e).__name__}: {e}") from None


def _json(value: Any, what: str) -> str:
    try:
        return json.dumps(value, separators=(",", ":"), sort_keys=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise Retry(f"cannot serialize {what}: {e}") from None


def encode_desired(desired: Any) -> Dict[str, Any]:
    """``desired`` as the contract's record, with JSON text for the objects."""
    if not isinstance(desired, Desired):
        raise Retry(f"reconcile returned {type(desired).__name__}, not capstan.Desired")
    return {
        "children": [_json(c, "a child") for c in desired.children],
        "status": None if desired.status_value is None else _json(desired.status_value, "the status"),
        "conditions": [(c.type, c.status, c.reason, c.message) for c in desired.conditions],
        "events": [(e.type, e.reason, e.message) for e in desired.events],
        "requeue_after_seconds": desired.requeue_after_seconds,
    }


def encode_finalized(result: Any) -> Dict[str, Any]:
    """``result`` as the contract's finalize-result record."""
    if not isinstance(result, Finalized):
        raise Retry(f"finalize returned {type(result).__name__}, not capstan.Finalized")
    return {
        "done": bool(result.done),
        "events": [(e.type, e.reason, e.message) for e in result.events],
        "requeue_after_seconds": result.requeue_after_seconds,
    }


def info_of(plugin: Plugin) -> PluginInfo:
    """The plugin's declaration, checked for the mistakes the host would refuse late."""
    info = plugin.describe()
    if not isinstance(info, PluginInfo):
        raise TypeError(f"describe returned {type(info).__name__}, not capstan.PluginInfo")
    return info

