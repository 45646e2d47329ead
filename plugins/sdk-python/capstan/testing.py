"""Test a plugin without a cluster and without wasm: call its ``reconcile`` with a fake
parent and children, in plain CPython, through the same conversions as the sandbox.

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
from .plugin import Plugin, encode_desired, encode_finalized, guarded, info_of, observe

Object = Dict[str, Any]


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


def _observed(plugin: Plugin, parent_obj: Object, children: List[Object]):
    info = info_of(plugin)
    indexed = []
    for c in children:
        index = info.child_index(c.get("apiVersion", ""), c.get("kind", ""))
        if index is None:
            raise ValueError(
                f"{c.get('kind')}.{c.get('apiVersion')} is not a child kind of plugin {info.name}: the host would never pass it"
            )
        indexed.append((index, json.dumps(c)))
    return observe(info, json.dumps(parent_obj), indexed)


def _check_child(manifest: Object) -> None:
    for field in ("apiVersion", "kind"):
        if not manifest.get(field):
            raise AssertionError(f"a child has no {field}: {manifest}")
    if not (manifest.get("metadata") or {}).get("name"):
        raise AssertionError(f"a child has no metadata.name: {manifest}")


def reconcile(plugin: Plugin, parent_obj: Object, children: Optional[List[Object]] = None) -> Desired:
    """Calls ``plugin.reconcile`` as the sandbox does: the objects cross as JSON, the
    result is encoded as for the host (so what cannot be serialized fails here too), and
    an unexpected exception becomes :class:`~capstan.Retry`. Returns the Desired decoded
    back from JSON; raises :class:`~capstan.Invalid` or :class:`~capstan.Retry`."""
    ctx = _observed(plugin, parent_obj, children or [])
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


def finalize(plugin: Plugin, parent_obj: Object, children: Optional[List[Object]] = None) -> Finalized:
    """Calls ``plugin.finalize`` as the sandbox does."""
    ctx = _observed(plugin, parent_obj, children or [])
    wire = encode_finalized(guarded(plugin.finalize, ctx))
    result = Finalized(wire["done"], [], wire["requeue_after_seconds"])
    for t, r, m in wire["events"]:
        result.event(r, m, t)
    return result


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
