"""Unit tests of the Python SDK: Context, Desired, errors, log, random and the test
harness in plain CPython; the component glue against the bindings componentize-py
generates from wit/capstan.wit."""

import json
import logging
import os
import subprocess
import sys
import tempfile
import unittest

import capstan
from capstan import CONFIG_MAP, SECRET, Context, Desired, Invalid, KindRef, Plugin, PluginInfo, Retry, log
from capstan.testing import as_observed, finalize, parent, reconcile

GREETING = KindRef("example.com", "v1", "Greeting", "greetings")
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


class Greeter(Plugin):
    """One ConfigMap per Greeting; the spec's `mode` makes it misbehave on purpose."""

    def describe(self):
        return PluginInfo("greeter", "0.0.1", GREETING, children=[CONFIG_MAP, SECRET])

    def reconcile(self, ctx):
        mode = ctx.spec.get("mode")
        if mode == "invalid":
            raise Invalid("spec.mode is invalid")
        if mode == "retry":
            raise Retry("try later")
        if mode == "bug":
            return {}["missing"]
        if mode == "set":
            return Desired().status({"x": {1, 2}})
        desired = Desired().child(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": f"{ctx.name}-greeting"},
                "data": {"message": ctx.spec.get("message", "")},
            }
        )
        seen = len(ctx.children(CONFIG_MAP))
        desired.status({"greeted": True, "seen": seen}).condition("Greeted", True, "Done", "said hi")
        if seen == 0:
            desired.event("Created", "made the ConfigMap")
        return desired.requeue_after(0.2)


def greeting(**spec):
    return parent("example.com/v1", "Greeting", spec=spec, name="hi", namespace="team", uid="u-1", generation=3)


class ContextTest(unittest.TestCase):
    def ctx(self, obj, children=()):
        info = Greeter().describe()
        return Context(info, obj, [(info.child_index(c["apiVersion"], c["kind"]), c) for c in children])

    def test_metadata_helpers(self):
        ctx = self.ctx(greeting(message="m"))
        self.assertEqual((ctx.name, ctx.namespace, ctx.uid, ctx.generation), ("hi", "team", "u-1", 3))
        self.assertEqual(ctx.spec, {"message": "m"})
        self.assertEqual(ctx.status, {})
        self.assertFalse(ctx.is_deleting)

    def test_children_by_kind_and_name(self):
        cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "a"}}
        sec = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "a"}}
        ctx = self.ctx(greeting(), [cm, sec])
        self.assertEqual(ctx.children(CONFIG_MAP), [cm])
        self.assertEqual(ctx.child(SECRET, "a"), sec)
        self.assertIsNone(ctx.child(SECRET, "b"))
        with self.assertRaises(ValueError):
            ctx.children(capstan.STATEFUL_SET)

    def test_a_spec_that_is_not_an_object_is_invalid(self):
        obj = greeting()
        obj["spec"] = [1]
        with self.assertRaises(Invalid):
            self.ctx(obj).spec

    def test_conditions_of_the_status(self):
        obj = greeting()
        obj["status"] = {"conditions": [{"type": "Ready", "reason": "R"}]}
        self.assertEqual(self.ctx(obj).condition("Ready")["reason"], "R")
        self.assertIsNone(self.ctx(obj).condition("Other"))

    def test_kind_refs(self):
        self.assertEqual(capstan.STATEFUL_SET.api_version, "apps/v1")
        self.assertEqual(SECRET.api_version, "v1")
        self.assertTrue(GREETING.matches("example.com/v1", "Greeting"))


class DesiredTest(unittest.TestCase):
    def test_builder_chains_and_copies(self):
        manifest = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "a"}}
        d = Desired().child(manifest).status({"phase": "Running"}).condition("Ready", False, "Why", "because")
        manifest["metadata"]["name"] = "changed"
        self.assertEqual(d.children[0]["metadata"]["name"], "a")
        self.assertEqual(d.child_named("ConfigMap", "a"), d.children[0])
        self.assertEqual(d.conditions[0].status, "False")
        self.assertEqual(d.requeue_after(0).requeue_after_seconds, 1)
        self.assertEqual(d.requeue_after(2**40).requeue_after_seconds, 2**32 - 1)

    def test_wrong_values_are_refused(self):
        with self.assertRaises(ValueError):
            Desired().condition("Ready", "yes", "R")
        with self.assertRaises(ValueError):
            Desired().event("R", "m", "Error")
        with self.assertRaises(Retry):
            Desired().status(["not", "a", "dict"])


class HarnessTest(unittest.TestCase):
    def test_reconcile_round_trips_through_json(self):
        d = reconcile(Greeter(), greeting(message="hello"))
        self.assertEqual(d.children[0]["data"], {"message": "hello"})
        self.assertEqual(d.status_value, {"greeted": True, "seen": 0})
        self.assertEqual([(e.type, e.reason) for e in d.events], [("Normal", "Created")])
        self.assertEqual(d.requeue_after_seconds, 1)
        again = reconcile(Greeter(), greeting(message="hello"), as_observed(d, "team"))
        self.assertEqual(again.status_value["seen"], 1)
        self.assertEqual(again.events, [])

    def test_errors_are_the_contract_s(self):
        with self.assertRaisesRegex(Invalid, "spec.mode is invalid"):
            reconcile(Greeter(), greeting(mode="invalid"))
        with self.assertRaisesRegex(Retry, "try later"):
            reconcile(Greeter(), greeting(mode="retry"))

    def test_a_bug_is_a_retry_naming_it_with_the_traceback_logged(self):
        with log.Captured() as lines:
            with self.assertRaisesRegex(Retry, "the plugin raised KeyError: 'missing'"):
                reconcile(Greeter(), greeting(mode="bug"))
        self.assertEqual(lines[0][0], "error")
        self.assertIn("Traceback", lines[0][1])

    def test_tracebacks_name_the_author_s_files_not_the_component_s(self):
        from capstan.plugin import author_paths

        inside = (
            'Traceback (most recent call last):\n'
            '  File "/1/capstan/plugin.py", line 101, in guarded\n'
            '  File "/0/banner/__init__.py", line 30, in reconcile\n'
            "KeyError: 'message'"
        )
        self.assertEqual(
            author_paths(inside),
            inside.replace('"/1/capstan', '"capstan').replace('"/0/banner', '"banner'),
        )
        # Paths of the author's own machine are left alone.
        self.assertEqual(author_paths('File "/home/a/x.py"'), 'File "/home/a/x.py"')

    def test_what_json_cannot_hold_is_a_retry(self):
        with self.assertRaisesRegex(Retry, "cannot serialize the status"):
            reconcile(Greeter(), greeting(mode="set"))

    def test_undeclared_children_are_refused(self):
        with self.assertRaisesRegex(ValueError, "not a child kind"):
            reconcile(Greeter(), greeting(), [{"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "x"}}])

    def test_finalize_defaults_to_done(self):
        self.assertTrue(finalize(Greeter(), greeting()).done)


class LogTest(unittest.TestCase):
    def test_levels_and_the_logging_handler(self):
        logger = logging.getLogger("capstan-test")
        logger.setLevel(logging.DEBUG)
        logger.addHandler(log.Handler())
        try:
            with log.Captured(min_level=log.INFO) as lines:
                log.debug("hidden")
                log.warn("shown")
                logger.info("via logging")
                logger.debug("hidden too")
                logger.error("bad")
        finally:
            logger.handlers.clear()
        self.assertEqual(lines, [("warn", "shown"), ("info", "via logging"), ("error", "bad")])
        with self.assertRaises(ValueError):
            log.log("fatal", "x")


class RandomTest(unittest.TestCase):
    def test_alphanumeric(self):
        p = capstan.random.alphanumeric(32)
        self.assertEqual(len(p), 32)
        self.assertTrue(p.isalnum() and p.isascii())
        self.assertNotEqual(p, capstan.random.alphanumeric(32))

    def test_uuid_v4(self):
        u = capstan.random.uuid_v4()
        self.assertEqual(len(u), 36)
        self.assertEqual(u[14], "4")
        self.assertIn(u[19], "89ab")


def generated_bindings(out):
    """Generates the bindings of wit/capstan.wit with componentize-py, as the build does."""
    code = "import sys; from componentize_py import script; sys.argv[0] = 'componentize-py'; sys.exit(script())"
    subprocess.run(
        [sys.executable, "-c", code, "-d", os.path.join(ROOT, "wit"), "-w", "plugin", "bindings", out],
        check=True,
        capture_output=True,
    )


@unittest.skipUnless(
    __import__("importlib").util.find_spec("componentize_py"),
    "componentize-py is not installed (cargo xtask test runs these with it)",
)
class ComponentTest(unittest.TestCase):
    """capstan.component.export against the real generated bindings, with the log import
    replaced by a recorder."""

    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.TemporaryDirectory()
        generated_bindings(cls.dir.name)
        sys.path.insert(0, cls.dir.name)
        from wit_world.imports import log as wit_log
        from wit_world.imports import types

        cls.types, cls.lines = types, []
        wit_log.enabled = lambda level: level.value >= wit_log.Level.INFO.value
        wit_log.log = lambda level, message: cls.lines.append((level.name, message))
        import capstan.component

        from tests.test_lifecycle import Keeper

        cls.reconciler = capstan.component.export(Greeter())()
        cls.keeper = capstan.component.export(Keeper())()

    @classmethod
    def tearDownClass(cls):
        sys.path.remove(cls.dir.name)
        log.set_backend(log._stderr_enabled, log._stderr_log)
        cls.dir.cleanup()

    def observed(self, **spec):
        return self.types.Observed(json.dumps(greeting(**spec)), [], [])

    def test_describe(self):
        info = self.reconciler.describe()
        self.assertEqual(info.name, "greeter")
        self.assertEqual([k.kind for k in info.children], ["ConfigMap", "Secret"])
        self.assertEqual(info.parent, self.types.KindRef("example.com", "v1", "Greeting", "greetings", True))
        self.assertEqual((info.related, info.validation, info.conversion), ([], None, False))

    def test_describe_related_validation_and_conversion(self):
        info = self.keeper.describe()
        self.assertEqual(
            info.related,
            [
                self.types.KindRef("", "v1", "ConfigMap", "configmaps", True),
                self.types.KindRef("", "v1", "Pod", "pods", True),
                self.types.KindRef("", "v1", "Namespace", "namespaces", False),
            ],
        )
        self.assertEqual(info.validation, self.types.FailurePolicy.FAIL)
        self.assertTrue(info.conversion)

    def test_reconcile_gives_the_wit_record(self):
        d = self.reconciler.reconcile(self.observed(message="m"))
        self.assertIsInstance(d, self.types.Desired)
        self.assertEqual(json.loads(d.children[0])["metadata"]["name"], "hi-greeting")
        self.assertEqual(json.loads(d.status), {"greeted": True, "seen": 0})
        self.assertEqual(d.conditions[0].status, self.types.ConditionStatus.TRUE)
        self.assertEqual(d.events[0].type, self.types.EventType.NORMAL)
        self.assertEqual(d.requeue_after_seconds, 1)

    def test_errors_map_to_the_wit_variant(self):
        from componentize_py_types import Err

        with self.assertRaises(Err) as e:
            self.reconciler.reconcile(self.observed(mode="invalid"))
        self.assertEqual(e.exception.value, self.types.Error_Invalid("spec.mode is invalid"))
        with self.assertRaises(Err) as e:
            self.reconciler.reconcile(self.observed(mode="bug"))
        self.assertIsInstance(e.exception.value, self.types.Error_Retry)
        self.assertTrue(any(level == "ERROR" and "KeyError" in m for level, m in self.lines))

    def test_finalize(self):
        result = self.reconciler.finalize(self.observed())
        self.assertTrue(result.done)
        self.assertEqual(result.delete, [])

    def cache(self, **spec):
        return json.dumps(parent("example.com/v2", "Cache", spec=spec, name="c", namespace="team"))

    def test_customize_gives_requests_by_kind_index(self):
        t = self.types
        self.assertEqual(
            self.keeper.customize(self.cache(config="settings")),
            [
                t.RelatedRequest(0, t.Selector_Name("settings")),
                t.RelatedRequest(1, t.Selector_Labels([("app", "c")])),
                t.RelatedRequest(2, t.Selector_Name("team")),
            ],
        )
        self.assertEqual(self.reconciler.customize(json.dumps(greeting())), [])

    def test_customize_errors_map_to_the_wit_variant(self):
        from componentize_py_types import Err

        with self.assertRaises(Err) as e:
            self.keeper.customize(self.cache(mode="undeclared"))
        self.assertEqual(
            e.exception.value,
            self.types.Error_Invalid("customize asks for Secret (v1), which the plugin does not declare as related"),
        )
        with self.assertRaises(Err) as e:
            self.keeper.customize(self.cache(mode="bug"))
        self.assertEqual(e.exception.value, self.types.Error_Retry("the plugin raised KeyError: 'missing'"))

    def test_related_objects_reach_reconcile(self):
        t = self.types
        cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "default"}, "data": {"k": "v"}}
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "c-0"}}
        observed = t.Observed(self.cache(), [], [t.RelatedObject(0, json.dumps(cm)), t.RelatedObject(1, json.dumps(pod))])
        self.assertEqual(
            json.loads(self.keeper.reconcile(observed).status),
            {"config": {"k": "v"}, "pods": ["c-0"], "namespace": None},
        )

    def test_finalize_names_a_wave_by_kind_index(self):
        t = self.types
        service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "c"}}
        result = self.keeper.finalize(t.Observed(self.cache(), [t.ObservedChild(1, json.dumps(service))], []))
        self.assertEqual(result.delete, [t.ChildRef(1, "c")])
        self.assertFalse(result.done)
        from componentize_py_types import Err

        with self.assertRaises(Err) as e:
            self.keeper.finalize(t.Observed(self.cache(mode="undeclared"), [], []))
        self.assertEqual(
            e.exception.value, t.Error_Invalid("finalize names ConfigMap 'settings' (v1), not a declared child kind")
        )

    def test_validate_allows_with_warnings_or_refuses_with_a_string(self):
        from componentize_py_types import Err

        self.assertEqual(self.keeper.validate(self.cache(replicas=3), self.cache(replicas=1)), ["scaling c down"])
        self.assertEqual(self.reconciler.validate(None, self.cache(replicas=-1)), [])
        with self.assertRaises(Err) as e:
            self.keeper.validate(None, self.cache(replicas=-1))
        self.assertEqual(e.exception.value, "spec.replicas must not be negative")
        with self.assertRaises(Err) as e:
            self.keeper.validate(None, self.cache(mode="bug"))
        self.assertEqual(e.exception.value, "the plugin raised KeyError: 'missing'")
        with self.assertRaises(Err) as e:
            self.keeper.validate(None, "{not json")
        self.assertTrue(e.exception.value.startswith("host sent an object that is not JSON"), e.exception.value)

    def test_convert_gives_json_text_or_refuses_with_a_string(self):
        from componentize_py_types import Err

        v1 = parent("example.com/v1", "Cache", spec={"size": 2}, name="c", namespace="team")
        v2 = json.loads(self.keeper.convert(json.dumps(v1), "v2"))
        self.assertEqual((v2["apiVersion"], v2["spec"]), ("example.com/v2", {"replicas": 2}))
        with self.assertRaises(Err) as e:
            self.reconciler.convert(json.dumps(v1), "v2")
        self.assertEqual(e.exception.value, "this plugin does not convert (asked for v2)")
        with self.assertRaises(Err) as e:
            self.keeper.convert(self.cache(mode="bug"), "v1")
        self.assertEqual(e.exception.value, "the plugin raised KeyError: 'missing'")


if __name__ == "__main__":
    unittest.main()
