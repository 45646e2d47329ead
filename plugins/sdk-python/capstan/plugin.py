"""The plugin interface, and the calls into it shared by the sandbox and the test harness."""

import json
import re
import traceback
from typing import Any, Dict, List, Optional, Tuple

from . import log
from .context import Context, Object
from .desired import Desired, Finalized
from .errors import Invalid, PluginError, Retry
from .info import FailurePolicy, PluginInfo
from .related import Related

# A related request as the contract carries it: (kind index, ("name", name)) or
# (kind index, ("labels", [(key, value), ...])).
WireRequest = Tuple[int, Tuple[str, Any]]


class Plugin:
    """A Capstan plugin. Subclass it, then export an instance from the component's
    ``app.py`` with ``Reconciler = capstan.component.export(MyPlugin())``.

    Only ``describe`` and ``reconcile`` are required; the others have defaults, so a
    plugin writes only what it uses."""

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
        ``PluginInfo.finalizer``. Return :meth:`Finalized.wave` s to delete children in
        order, then ``Finalized()``. The default reports done at once."""
        return Finalized()

    def customize(self, ctx: Context) -> List[Related]:
        """Which related objects this parent needs (only ``ctx.parent`` and what derives
        from it are set). Called before each ``reconcile`` and ``finalize`` of a plugin
        that declares ``PluginInfo.related``; the host reconciles the parent again when
        one of them changes. The default asks for none."""
        return []

    def validate(self, old: Optional[Object], new: Object) -> List[str]:
        """Admission: may a parent become ``new`` (``old`` is None on create)? Return
        warnings for ``kubectl`` to print (None or ``[]``: none), or raise
        :class:`~capstan.Invalid` to refuse with a one-line message. Called only when
        ``PluginInfo.validation`` is set. The default allows everything."""
        return []

    def convert(self, obj: Object, to_version: str) -> Object:
        """Conversion: ``obj`` (any version the CRD serves) as ``to_version`` of the same
        group, with ``apiVersion`` set to it. Must be lossless both ways. Raise
        :class:`~capstan.Invalid` to refuse. Called only when ``PluginInfo.conversion``
        is set. The default refuses."""
        raise Invalid(f"this plugin does not convert (asked for {to_version})")


def _parse(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise Retry(f"host sent {what} that is not JSON: {e}") from None


def observe(
    info: PluginInfo,
    parent: str,
    children: List[Tuple[int, str]],
    related: Optional[List[Tuple[int, str]]] = None,
) -> Context:
    """A :class:`Context` from the JSON texts the host passes."""
    return Context(
        info,
        _parse(parent, "a parent"),
        [(int(i), _parse(text, "a child")) for i, text in children],
        [(int(i), _parse(text, "a related object")) for i, text in related or []],
    )


def one_line(text: str) -> str:
    """``text`` with its line breaks folded, for messages read on one line."""
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


# componentize-py serves each `-p` directory of the build under `/0/`, `/1/`, ... inside
# the component, so a traceback names `/0/banner/__init__.py`.
_SEARCH_PATH_PREFIX = re.compile(r'File "/\d+/')


def author_paths(text: str) -> str:
    """A traceback with the paths the author knows: relative to the directory given to
    the build (``banner/__init__.py``), not the component's ``/0/banner/__init__.py``."""
    return _SEARCH_PATH_PREFIX.sub('File "', text)


def guarded(call, *args, what: str = "reconcile"):
    """Runs a plugin method; an exception other than Invalid or Retry is a bug in the
    plugin: its traceback goes to the log at error level and the caller gets a Retry
    that names it on one line (the host backs off and reports it on the parent, or
    refuses the admission or conversion with it)."""
    try:
        return call(*args)
    except PluginError:
        raise
    except Exception as e:
        trace = "".join(traceback.format_exception(e)).rstrip()
        log.error(f"{what} raised {type(e).__name__} (a bug in the plugin): {author_paths(trace)}")
        raise Retry(one_line(f"the plugin raised {type(e).__name__}: {e}")) from None


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


def encode_finalized(result: Any, info: PluginInfo) -> Dict[str, Any]:
    """``result`` as the contract's finalize-result record; the children to delete as
    (index into ``info.children``, name). A child of an undeclared kind is Invalid."""
    if not isinstance(result, Finalized):
        raise Retry(f"finalize returned {type(result).__name__}, not capstan.Finalized")
    delete = []
    for api_version, kind, name in result.deletes:
        index = info.child_index(api_version, kind)
        if index is None:
            raise Invalid(f"finalize names {kind} {name!r} ({api_version}), not a declared child kind")
        delete.append((index, name))
    return {
        "done": bool(result.done),
        "events": [(e.type, e.reason, e.message) for e in result.events],
        "requeue_after_seconds": result.requeue_after_seconds,
        "delete": delete,
    }


def call_customize(plugin: Plugin, info: PluginInfo, parent: str) -> List[WireRequest]:
    """``customize`` on the parent's JSON text: its requests as the contract carries
    them. A request of an undeclared kind is Invalid; a bug is a Retry naming it."""
    ctx = Context(info, _parse(parent, "a parent"), [])
    requests = guarded(plugin.customize, ctx, what="customize")
    if requests is None:
        return []
    if not isinstance(requests, (list, tuple)):
        raise Retry(f"customize returned {type(requests).__name__}, not a list of capstan.Related")
    return [_encode_request(r, info) for r in requests]


def _encode_request(request: Any, info: PluginInfo) -> WireRequest:
    if not isinstance(request, Related):
        raise Retry(f"customize returned a {type(request).__name__}, not a capstan.Related")
    kind = request.kind
    index = info.related_index(kind.api_version, kind.kind)
    if index is None:
        raise Invalid(
            f"customize asks for {kind.kind} ({kind.api_version}), which the plugin does not declare as related"
        )
    if request.name is not None:
        return index, ("name", request.name)
    return index, ("labels", list(request.labels or ()))


def call_validate(plugin: Plugin, old: Optional[str], new: str) -> List[str]:
    """``validate`` on the JSON texts the host passes: the warnings of an allowed
    change. A refusal is a PluginError whose message is the one line the user reads:
    the plugin's Invalid (or Retry), or a bug named by ``guarded``."""
    old_obj = None if old is None else _parse(old, "an old object")
    new_obj = _parse(new, "an object")
    warnings = guarded(plugin.validate, old_obj, new_obj, what="validate")
    if warnings is None:
        return []
    if not isinstance(warnings, (list, tuple)) or not all(isinstance(w, str) for w in warnings):
        raise Retry(f"validate returned {warnings!r}, not a list of warning strings")
    return list(warnings)


def call_convert(plugin: Plugin, obj: str, to_version: str) -> str:
    """``convert`` on the JSON text the host passes: the converted object as JSON text.
    A refusal is a PluginError, as for :func:`call_validate`."""
    converted = guarded(plugin.convert, _parse(obj, "an object"), to_version, what="convert")
    if not isinstance(converted, dict):
        raise Retry(f"convert returned {type(converted).__name__}, not a dict")
    return _json(converted, "the converted object")


def refusal(e: PluginError) -> str:
    """The one line a user reads when ``validate`` or ``convert`` refuses."""
    return one_line(e.message)


def info_of(plugin: Plugin) -> PluginInfo:
    """The plugin's declaration, checked for the mistakes the host would refuse late."""
    info = plugin.describe()
    if not isinstance(info, PluginInfo):
        raise TypeError(f"describe returned {type(info).__name__}, not capstan.PluginInfo")
    if info.validation is not None and not isinstance(info.validation, FailurePolicy):
        raise TypeError(
            f"PluginInfo.validation is {info.validation!r}, not None or capstan.FailurePolicy.FAIL or IGNORE"
        )
    return info
