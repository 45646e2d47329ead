"""The component's side of the contract: ``export`` turns a :class:`~capstan.Plugin` into
the ``Reconciler`` class componentize-py exports as ``capstan:plugin/reconciler``.

Only importable inside ``componentize-py componentize`` (it imports the generated
``wit_world`` bindings). componentize-py runs the app module's top level while building
and snapshots the result, so every module a plugin uses must be imported at top level:
the sandbox has no file system to import from later.
"""

from . import log
from .errors import Invalid, PluginError
from .info import FailurePolicy
from .plugin import (
    Plugin,
    call_convert,
    call_customize,
    call_validate,
    encode_desired,
    encode_finalized,
    guarded,
    info_of,
    observe,
    refusal,
)


def export(plugin: Plugin):
    """The ``Reconciler`` class for ``plugin``; assign it in ``app.py``::

        Reconciler = capstan.component.export(MyPlugin())
    """
    from componentize_py_types import Err
    from wit_world import exports
    from wit_world.imports import log as wit_log
    from wit_world.imports import types

    levels = {
        log.TRACE: wit_log.Level.TRACE,
        log.DEBUG: wit_log.Level.DEBUG,
        log.INFO: wit_log.Level.INFO,
        log.WARN: wit_log.Level.WARN,
        log.ERROR: wit_log.Level.ERROR,
    }
    log.set_backend(
        lambda level: wit_log.enabled(levels[level]),
        lambda level, message: wit_log.log(levels[level], message),
    )
    statuses = {
        "True": types.ConditionStatus.TRUE,
        "False": types.ConditionStatus.FALSE,
        "Unknown": types.ConditionStatus.UNKNOWN,
    }
    event_types = {"Normal": types.EventType.NORMAL, "Warning": types.EventType.WARNING}
    policies = {FailurePolicy.FAIL: types.FailurePolicy.FAIL, FailurePolicy.IGNORE: types.FailurePolicy.IGNORE}

    # Described once, at build time: the snapshot holds it for every fresh instance.
    info = info_of(plugin)

    def kind(k):
        return types.KindRef(k.group, k.version, k.kind, k.plural, k.namespaced)

    def events(encoded):
        return [types.Event(event_types[t], r, m) for t, r, m in encoded]

    def wit_error(e):
        if isinstance(e, Invalid):
            return Err(types.Error_Invalid(e.message))
        return Err(types.Error_Retry(e.message))

    def context(observed):
        return observe(
            info,
            observed.parent,
            [(c.kind_index, c.object) for c in observed.children],
            [(r.kind_index, r.object) for r in observed.related],
        )

    def selector(encoded):
        how, value = encoded
        return types.Selector_Name(value) if how == "name" else types.Selector_Labels(value)

    class Reconciler(exports.Reconciler):
        def describe(self):
            return types.PluginInfo(
                name=info.name,
                version=info.version,
                parent=kind(info.parent),
                children=[kind(k) for k in info.children],
                finalizer=info.finalizer,
                resync_seconds=info.resync_seconds,
                crd=info.crd,
                related=[kind(k) for k in info.related],
                validation=None if info.validation is None else policies[info.validation],
                conversion=bool(info.conversion),
            )

        def customize(self, parent):
            try:
                requests = call_customize(plugin, info, parent)
            except PluginError as e:
                raise wit_error(e) from None
            return [types.RelatedRequest(i, selector(s)) for i, s in requests]

        def reconcile(self, observed):
            try:
                d = encode_desired(guarded(lambda: plugin.reconcile(context(observed))))
            except PluginError as e:
                raise wit_error(e) from None
            return types.Desired(
                children=d["children"],
                status=d["status"],
                conditions=[types.Condition(t, statuses[s], r, m) for t, s, r, m in d["conditions"]],
                events=events(d["events"]),
                requeue_after_seconds=d["requeue_after_seconds"],
            )

        def finalize(self, observed):
            try:
                f = encode_finalized(guarded(lambda: plugin.finalize(context(observed)), what="finalize"), info)
            except PluginError as e:
                raise wit_error(e) from None
            return types.FinalizeResult(
                done=f["done"],
                events=events(f["events"]),
                requeue_after_seconds=f["requeue_after_seconds"],
                delete=[types.ChildRef(i, name) for i, name in f["delete"]],
            )

        def validate(self, old, new):
            try:
                return call_validate(plugin, old, new)
            except PluginError as e:
                raise Err(refusal(e)) from None

        def convert(self, object, to_version):
            try:
                return call_convert(plugin, object, to_version)
            except PluginError as e:
                raise Err(refusal(e)) from None

    return Reconciler

