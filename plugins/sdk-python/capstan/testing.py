"""Test a plugin without a cluster and without wasm: call its ``reconcile``,
``finalize``, ``customize``, ``validate`` or ``convert`` with a fake parent, children and
related objects, in plain CPython, through the same conversions as the sandbox.

    from capstan.testing import parent, reconcile
    desired = reconcile(MyPlugin(), parent("example.com/v1", "Greeting", spec={...}))
    assert desired.children[0]["kind"] == "ConfigMap"

The host's own render path (``capstan render``, or golden tests in Rust) remains the
check of the built component.
"""

import copy
import json
from typing import Any, Dict, List, Optional

from .desired import Desired, Finalized
from .errors import PluginError
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
from .related import Related

Object = Dict[str, Any]


class Refused(Exception):
    """``validate`` or ``convert`` refused: ``message`` is the one line the user reads
    (the contract carries a refusal as a string, whether the plugin raised Invalid,
    Retry or anything else)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


def parent(
    api_version: str,
    kind: str,
    spec: Optional[Object] = None,
    status: Optional[Object] = None,
    name: str = "test",
    namespace: str = "default",
    uid: str = "00000000-0000-0000-0000-000000000000",
    generation: int = 1,
) -> Object:
    """A parent object as the API server would return it."""
    obj: Object = {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": {"name": name, "namespace": namespace, "uid": uid, "generation": generation},
    }
    if spec is not None:
        obj["spec"] = spec
    if status is not None:
        obj["status"] = status
    return obj


def _indexed(objects: List[Object], find, what: str, plugin_name: str):
    indexed = []
    for o in objects:
        index = find(o.get("apiVersion", ""), o.get("kind", ""))
        if index is None:
            raise ValueError(
                f"{o.get('kind')}.{o.get('apiVersion')} is not a {what} kind of plugin {plugin_name}: the host would never pass it"
            )
        indexed.append((index, json.dumps(o)))
    return indexed


def _observed(plugin: Plugin, parent_obj: Object, children: List[Object], related: List[Object]):
    info = info_of(plugin)
    return observe(
        info,
        json.dumps(parent_obj),
        _indexed(children, info.child_index, "child", info.name),
        _indexed(related, info.related_index, "related", info.name),
    )


def _check_child(manifest: Object) -> None:
    for field in ("apiVersion", "kind"):
        if not manifest.get(field):
            raise AssertionError(f"a child has no {field}: {manifest}")
    if not (manifest.get("metadata") or {}).get("name"):
        raise AssertionError(f"a child has no metadata.name: {manifest}")


def reconcile(
    plugin: Plugin,
    parent_obj: Object,
    children: Optional[List[Object]] = None,
    related: Optional[List[Object]] = None,
) -> Desired:
    """Calls ``plugin.reconcile`` as the sandbox does: the objects cross as JSON, the
    result is encoded as for the host (so what cannot be serialized fails here too), and
    an unexpected exception becomes :class:`~capstan.Retry`. ``related`` are the objects
    the host would pass for what ``customize`` asked (matched to the declared related
    kinds by ``apiVersion`` and ``kind``). Returns the Desired decoded back from JSON;
    raises :class:`~capstan.Invalid` or :class:`~capstan.Retry`."""
    ctx = _observed(plugin, parent_obj, children or [], related or [])
    desired = guarded(plugin.reconcile, ctx)
    wire = encode_desired(desired)
    decoded = Desired()
    for text in wire["children"]:
        manifest = json.loads(text)
        _check_child(manifest)
        decoded.child(manifest)
    if wire["status"] is not None:
        decoded.status(json.loads(wire["status"]))
    for t, s, r, m in wire["conditions"]:
        decoded.condition(t, s, r, m)
    for t, r, m in wire["events"]:
        decoded.event(r, m, t)
    decoded.requeue_after_seconds = wire["requeue_after_seconds"]
    return decoded


def finalize(
    plugin: Plugin,
    parent_obj: Object,
    children: Optional[List[Object]] = None,
    related: Optional[List[Object]] = None,
) -> Finalized:
    """Calls ``plugin.finalize`` as the sandbox does. The result's ``deletes`` are read
    back from the kind indexes the host receives; a child of an undeclared kind is
    :class:`~capstan.Invalid`."""
    info = info_of(plugin)
    ctx = _observed(plugin, parent_obj, children or [], related or [])
    wire = encode_finalized(guarded(plugin.finalize, ctx, what="finalize"), info)
    result = Finalized(wire["done"], [], wire["requeue_after_seconds"])
    for t, r, m in wire["events"]:
        result.event(r, m, t)
    for index, name in wire["delete"]:
        result.delete(info.children[index], name)
    return result


def customize(plugin: Plugin, parent_obj: Object) -> List[Related]:
    """Calls ``plugin.customize`` as the sandbox does and returns its requests read back
    from the kind indexes the host receives. A request of an undeclared kind is
    :class:`~capstan.Invalid`; a bug is :class:`~capstan.Retry`."""
    info = info_of(plugin)
    requests = []
    for index, (how, value) in call_customize(plugin, info, json.dumps(parent_obj)):
        kind = info.related[index]
        requests.append(Related.named(kind, value) if how == "name" else Related.labelled(kind, value))
    return requests


def validate(plugin: Plugin, old: Optional[Object], new: Object) -> List[str]:
    """Calls ``plugin.validate`` as the admission webhook does (``old`` is None on
    create): returns the warnings of an allowed change, raises :class:`Refused` with
    the one-line message of a refused one."""
    try:
        return call_validate(plugin, None if old is None else json.dumps(old), json.dumps(new))
    except PluginError as e:
        raise Refused(refusal(e)) from None


def convert(plugin: Plugin, obj: Object, to_version: str) -> Object:
    """Calls ``plugin.convert`` as the conversion webhook does: returns the converted
    object read back from JSON, raises :class:`Refused` with the one-line message of a
    refusal."""
    try:
        return json.loads(call_convert(plugin, json.dumps(obj), to_version))
    except PluginError as e:
        raise Refused(refusal(e)) from None


def as_observed(desired: Desired, namespace: str = "default") -> List[Object]:
    """The desired children as the API server would return them after the apply: with a
    namespace and a uid. Add a ``status`` to the ones that need it."""
    out = []
    for c in desired.children:
        c = copy.deepcopy(c)
        meta = c.setdefault("metadata", {})
        meta.setdefault("namespace", namespace)
        meta.setdefault("uid", f"uid-{c['kind'].lower()}-{meta['name']}")
        meta.setdefault("generation", 1)
        out.append(c)
    return out
