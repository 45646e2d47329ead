"""Unit tests of what contract 0.2.0 added to the Python SDK, in plain CPython: related
objects (customize and the Context accessors), teardown waves, admission validation and
conversion, with their defaults and their refusals."""

import unittest

from capstan import (
    CONFIG_MAP,
    NAMESPACE,
    POD,
    SECRET,
    SERVICE,
    STATEFUL_SET,
    Context,
    Desired,
    FailurePolicy,
    Finalized,
    Invalid,
    KindRef,
    Plugin,
    PluginInfo,
    Related,
    Retry,
    log,
)
from capstan.plugin import info_of
from capstan.testing import Refused, convert, customize, finalize, parent, reconcile, validate

CACHE = KindRef("example.com", "v2", "Cache", "caches")


def cache(name="c", namespace="team", api_version="example.com/v2", **spec):
    return parent(api_version, "Cache", spec=spec, name=name, namespace=namespace)


def obj(kind, name, api_version="v1", **fields):
    return {"apiVersion": api_version, "kind": kind, "metadata": {"name": name, **fields}}


class Keeper(Plugin):
    """A Cache (example.com/v2, served as v1 too) with a StatefulSet and a Service, that
    reads a ConfigMap, its Pods and its Namespace; the spec's `mode` makes each hook
    misbehave on purpose."""

    def describe(self):
        return PluginInfo(
            "keeper",
            "0.0.1",
            CACHE,
            children=[STATEFUL_SET, SERVICE],
            finalizer=True,
            related=[CONFIG_MAP, POD, NAMESPACE],
            validation=FailurePolicy.FAIL,
            conversion=True,
        )

    def customize(self, ctx):
        mode = ctx.spec.get("mode")
        if mode == "undeclared":
            return [Related.named(SECRET, "creds")]
        if mode == "bug":
            return {}["missing"]
        if mode == "none":
            return None
        if mode == "not-a-list":
            return Related.named(CONFIG_MAP, "x")
        if mode == "multi-line":
            raise RuntimeError("first line\n  second line\n")
        return [
            Related.named(CONFIG_MAP, ctx.spec.get("config", "default")),
            Related.labelled(POD, {"app": ctx.name}),
            Related.named(NAMESPACE, ctx.namespace),
        ]

    def reconcile(self, ctx):
        config = ctx.related_named(CONFIG_MAP, ctx.spec.get("config", "default"))
        namespaces = ctx.related(NAMESPACE)
        return Desired().status(
            {
                "config": None if config is None else config.get("data"),
                "pods": sorted(p["metadata"]["name"] for p in ctx.related(POD)),
                "namespace": namespaces[0]["metadata"]["name"] if namespaces else None,
            }
        )

    def finalize(self, ctx):
        if ctx.spec.get("mode") == "undeclared":
            return Finalized.wave().delete(CONFIG_MAP, "settings")
        if ctx.spec.get("mode") == "bug":
            return {}["missing"]
        # The StatefulSet goes first, so that its Pods stop before the Service goes.
        if ctx.child(STATEFUL_SET, ctx.name):
            return Finalized.wave().delete(STATEFUL_SET, ctx.name).event("Stopping", "the StatefulSet goes first")
        if ctx.child(SERVICE, ctx.name):
            return Finalized.wave().delete(SERVICE, ctx.name)
        return Finalized()

    def validate(self, old, new):
        spec = new.get("spec") or {}
        mode = spec.get("mode")
        if mode == "bug":
            return {}["missing"]
        if mode == "multi-line":
            raise ValueError("first line\nsecond line")
        if mode == "retry":
            raise Retry("try again")
        if mode == "not-a-list":
            return "fine"
        if mode == "none":
            return None
        if spec.get("replicas", 1) < 0:
            raise Invalid("spec.replicas must not be negative")
        if old is not None and (old.get("spec") or {}).get("replicas", 1) > spec.get("replicas", 1):
            return [f"scaling {new['metadata']['name']} down"]
        return []

    def convert(self, obj, to_version):
        obj = dict(obj)
        spec = dict(obj.get("spec") or {})
        if spec.get("mode") == "bug":
            return {}["missing"]
        if spec.get("mode") == "not-a-dict":
            return [obj]
        if to_version == "v1":
            if "replicas" in spec:
                spec["size"] = spec.pop("replicas")
        elif to_version == "v2":
            if "size" in spec:
                spec["replicas"] = spec.pop("size")
        else:
            raise Invalid(f"Cache has no version {to_version}")
        obj["apiVersion"] = f"example.com/{to_version}"
        obj["spec"] = spec
        return obj


class Minimal(Plugin):
    """Only describe and reconcile: every 0.2.0 hook takes its default."""

    def describe(self):
        return PluginInfo("minimal", "0.0.1", CACHE, children=[SERVICE], finalizer=True)

    def reconcile(self, ctx):
        return Desired()


class DeclarationTest(unittest.TestCase):
    def test_defaults_declare_nothing_new(self):
        info = Minimal().describe()
        self.assertEqual((info.related, info.validation, info.conversion), ([], None, False))

    def test_related_kinds_have_their_own_indexes(self):
        info = Keeper().describe()
        self.assertEqual(info.related_index("v1", "Pod"), 1)
        self.assertEqual(info.related_index("v1", "Namespace"), 2)
        self.assertIsNone(info.related_index("apps/v1", "StatefulSet"))
        self.assertEqual(info.child_index("apps/v1", "StatefulSet"), 0)
        self.assertFalse(NAMESPACE.namespaced)

    def test_a_failure_policy_that_is_not_the_enum_is_refused_at_build(self):
        class Wrong(Minimal):
            def describe(self):
                return PluginInfo("wrong", "0", CACHE, validation="fail")

        with self.assertRaisesRegex(TypeError, "not None or capstan.FailurePolicy"):
            info_of(Wrong())


class RelatedTest(unittest.TestCase):
    def test_named_and_labelled(self):
        self.assertEqual(Related.named(CONFIG_MAP, "a"), Related(CONFIG_MAP, name="a"))
        by_dict = Related.labelled(POD, {"app": "x", "tier": "db"})
        self.assertEqual(by_dict.labels, (("app", "x"), ("tier", "db")))
        self.assertEqual(Related.labelled(POD, [("app", "x"), ["tier", "db"]]), by_dict)
        self.assertEqual(Related.labelled(POD, {}).labels, ())

    def test_wrong_arguments_are_type_errors(self):
        for call, why in [
            (lambda: Related.named(CONFIG_MAP, None), "non-empty name"),
            (lambda: Related.named(CONFIG_MAP, ""), "non-empty name"),
            (lambda: Related.named("ConfigMap", "a"), "needs a KindRef"),
            (lambda: Related.labelled(POD, {"app": 1}), "string label keys and values"),
            (lambda: Related.labelled(POD, ["app"]), "string label keys and values"),
        ]:
            with self.assertRaisesRegex(TypeError, why):
                call()


class ContextRelatedTest(unittest.TestCase):
    def test_related_by_kind_and_name(self):
        info = Keeper().describe()
        cm = obj("ConfigMap", "settings")
        pods = [obj("Pod", "c-0"), obj("Pod", "c-1")]
        ctx = Context(info, cache(), [], [(0, cm), (1, pods[0]), (1, pods[1])])
        self.assertEqual(ctx.related(POD), pods)
        self.assertEqual(ctx.related_named(CONFIG_MAP, "settings"), cm)
        self.assertIsNone(ctx.related_named(CONFIG_MAP, "other"))
        self.assertEqual(ctx.related(NAMESPACE), [])
        self.assertEqual([k.kind for k, _ in ctx.all_related()], ["ConfigMap", "Pod", "Pod"])

    def test_a_kind_not_declared_related_is_a_value_error(self):
        ctx = Context(Keeper().describe(), cache(), [])
        with self.assertRaisesRegex(ValueError, "StatefulSet.apps/v1 is not a declared related kind"):
            ctx.related(STATEFUL_SET)
        with self.assertRaisesRegex(ValueError, "not a declared related kind"):
            ctx.related_named(SECRET, "x")


class CustomizeTest(unittest.TestCase):
    def test_requests_by_name_and_by_labels(self):
        self.assertEqual(
            customize(Keeper(), cache(config="settings")),
            [
                Related.named(CONFIG_MAP, "settings"),
                Related.labelled(POD, {"app": "c"}),
                Related.named(NAMESPACE, "team"),
            ],
        )

    def test_defaults_to_no_requests(self):
        self.assertEqual(customize(Minimal(), cache()), [])
        self.assertEqual(customize(Keeper(), cache(mode="none")), [])

    def test_an_undeclared_kind_is_invalid_naming_it(self):
        with self.assertRaisesRegex(
            Invalid, r"^customize asks for Secret \(v1\), which the plugin does not declare as related$"
        ):
            customize(Keeper(), cache(mode="undeclared"))

    def test_a_bug_is_a_one_line_retry_with_the_traceback_logged(self):
        with log.Captured() as lines:
            with self.assertRaisesRegex(Retry, r"^the plugin raised KeyError: 'missing'$"):
                customize(Keeper(), cache(mode="bug"))
        self.assertEqual(lines[0][0], "error")
        self.assertRegex(lines[0][1], r"^customize raised \w+ \(a bug in the plugin\): Traceback")

    def test_a_bug_s_message_is_folded_onto_one_line(self):
        with log.Captured():
            with self.assertRaisesRegex(Retry, "^the plugin raised RuntimeError: first line second line$"):
                customize(Keeper(), cache(mode="multi-line"))

    def test_anything_but_a_list_of_related_is_a_retry(self):
        with self.assertRaisesRegex(Retry, "customize returned Related, not a list"):
            customize(Keeper(), cache(mode="not-a-list"))


class ReconcileWithRelatedTest(unittest.TestCase):
    def test_related_objects_reach_reconcile(self):
        related = [
            obj("ConfigMap", "settings"),
            obj("Pod", "c-1"),
            obj("Pod", "c-0"),
            obj("Namespace", "team"),
        ]
        related[0]["data"] = {"size": "3"}
        d = reconcile(Keeper(), cache(config="settings"), [], related)
        self.assertEqual(d.status_value, {"config": {"size": "3"}, "pods": ["c-0", "c-1"], "namespace": "team"})

    def test_none_asked_none_passed(self):
        d = reconcile(Keeper(), cache())
        self.assertEqual(d.status_value, {"config": None, "pods": [], "namespace": None})

    def test_an_undeclared_related_object_is_refused(self):
        with self.assertRaisesRegex(ValueError, "Secret.v1 is not a related kind of plugin keeper"):
            reconcile(Keeper(), cache(), [], [obj("Secret", "s")])


class TeardownWaveTest(unittest.TestCase):
    def children(self):
        return [obj("StatefulSet", "c", "apps/v1"), obj("Service", "c")]

    def test_waves_in_order_then_done(self):
        first = finalize(Keeper(), cache(), self.children())
        self.assertFalse(first.done)
        self.assertEqual(first.deletes, [("apps/v1", "StatefulSet", "c")])
        self.assertEqual([(e.type, e.reason) for e in first.events], [("Normal", "Stopping")])
        second = finalize(Keeper(), cache(), self.children()[1:])
        self.assertEqual(second.deletes, [("v1", "Service", "c")])
        last = finalize(Keeper(), cache(), [])
        self.assertTrue(last.done)
        self.assertEqual(last.deletes, [])

    def test_the_wire_carries_kind_indexes(self):
        from capstan.plugin import encode_finalized

        info = Keeper().describe()
        wire = encode_finalized(Finalized.wave().delete(SERVICE, "a").delete(STATEFUL_SET, "b"), info)
        self.assertEqual(wire["delete"], [(1, "a"), (0, "b")])
        self.assertFalse(wire["done"])

    def test_defaults_to_done(self):
        self.assertEqual(finalize(Minimal(), cache(), [obj("Service", "c")]), Finalized())

    def test_a_wave_naming_an_undeclared_kind_is_invalid(self):
        with self.assertRaisesRegex(Invalid, r"^finalize names ConfigMap 'settings' \(v1\), not a declared child kind$"):
            finalize(Keeper(), cache(mode="undeclared"))

    def test_a_bug_in_finalize_is_a_retry(self):
        with log.Captured() as lines:
            with self.assertRaisesRegex(Retry, "^the plugin raised KeyError: 'missing'$"):
                finalize(Keeper(), cache(mode="bug"))
        self.assertRegex(lines[0][1], r"^finalize raised \w+ \(a bug in the plugin\): Traceback")

    def test_wrong_arguments_are_type_errors(self):
        with self.assertRaisesRegex(TypeError, "needs a KindRef"):
            Finalized.wave().delete("Service", "a")
        with self.assertRaisesRegex(TypeError, "non-empty name"):
            Finalized.wave().delete(SERVICE, "")


class ValidateTest(unittest.TestCase):
    def test_allows_with_warnings(self):
        self.assertEqual(validate(Keeper(), None, cache(replicas=3)), [])
        self.assertEqual(validate(Keeper(), cache(replicas=3), cache(replicas=1)), ["scaling c down"])
        self.assertEqual(validate(Keeper(), None, cache(mode="none")), [])

    def test_refuses_with_the_plugin_s_message(self):
        with self.assertRaisesRegex(Refused, "^spec.replicas must not be negative$"):
            validate(Keeper(), None, cache(replicas=-1))
        with self.assertRaisesRegex(Refused, "^try again$"):
            validate(Keeper(), None, cache(mode="retry"))

    def test_defaults_to_allowing_everything(self):
        self.assertEqual(validate(Minimal(), None, cache(replicas=-1)), [])
        self.assertEqual(validate(Minimal(), cache(), cache(anything="goes")), [])

    def test_a_bug_is_a_one_line_refusal_without_the_traceback(self):
        with log.Captured() as lines:
            with self.assertRaises(Refused) as refused:
                validate(Keeper(), None, cache(mode="bug"))
        self.assertEqual(refused.exception.message, "the plugin raised KeyError: 'missing'")
        self.assertRegex(lines[0][1], r"^validate raised \w+ \(a bug in the plugin\): Traceback")
        with log.Captured():
            with self.assertRaises(Refused) as refused:
                validate(Keeper(), None, cache(mode="multi-line"))
        self.assertEqual(refused.exception.message, "the plugin raised ValueError: first line second line")

    def test_anything_but_a_list_of_strings_is_a_refusal(self):
        with self.assertRaisesRegex(Refused, "^validate returned 'fine', not a list of warning strings$"):
            validate(Keeper(), None, cache(mode="not-a-list"))


class ConvertTest(unittest.TestCase):
    def test_both_ways(self):
        v1 = cache(api_version="example.com/v1", size=3)
        v2 = convert(Keeper(), v1, "v2")
        self.assertEqual((v2["apiVersion"], v2["spec"]), ("example.com/v2", {"replicas": 3}))
        self.assertEqual(convert(Keeper(), v2, "v1"), v1)

    def test_refuses_with_the_plugin_s_message(self):
        with self.assertRaisesRegex(Refused, "^Cache has no version v3$"):
            convert(Keeper(), cache(), "v3")

    def test_defaults_to_refusing(self):
        with self.assertRaisesRegex(Refused, r"^this plugin does not convert \(asked for v1\)$"):
            convert(Minimal(), cache(), "v1")

    def test_a_bug_is_a_one_line_refusal_without_the_traceback(self):
        with log.Captured() as lines:
            with self.assertRaises(Refused) as refused:
                convert(Keeper(), cache(mode="bug"), "v1")
        self.assertEqual(refused.exception.message, "the plugin raised KeyError: 'missing'")
        self.assertNotIn("Traceback", refused.exception.message)
        self.assertRegex(lines[0][1], r"^convert raised \w+ \(a bug in the plugin\): Traceback")

    def test_anything_but_a_dict_is_a_refusal(self):
        with self.assertRaisesRegex(Refused, "^convert returned list, not a dict$"):
            convert(Keeper(), cache(mode="not-a-dict"), "v1")


if __name__ == "__main__":
    unittest.main()
