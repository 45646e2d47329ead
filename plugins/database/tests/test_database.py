"""Unit tests of the Database plugin in plain CPython, through capstan.testing: the spec
rules, each engine's children and status, the password's life, refusals, and the
admission check of an engine change."""

import base64
import unittest

from capstan import FailurePolicy, Invalid
from capstan.testing import Refused, as_observed, convert, customize, finalize, parent, reconcile, validate

from database import DatabasePlugin, spec

PLUGIN = DatabasePlugin()


def db(status=None, **fields):
    return parent("mycompany.com/v1", "Database", spec=fields, status=status, name="app", namespace="prod")


def kinds(desired):
    return [(c["kind"], c["metadata"]["name"]) for c in desired.children]


class SpecTest(unittest.TestCase):
    def test_postgresql_version_rule(self):
        self.assertEqual(spec.postgresql_version("16"), spec.POSTGRESQL_MINORS[16])
        self.assertEqual(spec.postgresql_version("16.4"), "16.4")
        for bad, why in [("12", "runs PostgreSQL 13 to 18"), ("12.4", "runs PostgreSQL"), ("16.x", "not a PostgreSQL major"), ("", "not")]:
            with self.assertRaisesRegex(Invalid, why):
                spec.postgresql_version(bad)
        for major, minor in spec.POSTGRESQL_MINORS.items():
            self.assertRegex(minor, rf"^{major}\.[0-9]+$")

    def test_defaults(self):
        c = spec.parse({"engine": "mysql"})
        self.assertEqual((c.version, c.storage, c.replicas), ("8.4", "10Gi", 1))
        self.assertEqual(spec.parse({"engine": "postgresql"}).version, spec.POSTGRESQL_MINORS[17])

    def test_what_the_crd_refuses_is_invalid(self):
        for fields, why in [
            ({}, "spec.engine is required"),
            ({"engine": "oracle"}, '"oracle" is not one of postgresql, mysql'),
            ({"engine": "postgresql", "replicas": 0}, "between 1 and 5"),
            ({"engine": "postgresql", "replicas": 6}, "between 1 and 5"),
            ({"engine": "postgresql", "replicas": True}, "not an integer"),
            ({"engine": "postgresql", "storage": "lots"}, "not a Kubernetes quantity"),
            ({"engine": "postgresql", "version": 16}, "quote it"),
            ({"engine": "mysql", "version": "5.7"}, "MySQL 8.0 and later"),
            ({"engine": "mysql", "replicas": 3}, "MySQL replication is not implemented"),
        ]:
            with self.assertRaisesRegex(Invalid, why):
                reconcile(PLUGIN, db(**fields))


class PostgresqlTest(unittest.TestCase):
    def test_one_cluster_and_its_status_mirrored(self):
        d = reconcile(PLUGIN, db(engine="postgresql", version="16", storage="5Gi", replicas=3))
        self.assertEqual(kinds(d), [("PostgreSQLCluster", "app")])
        self.assertEqual(d.children[0]["spec"], {"replicas": 3, "version": "16.15", "storage": "5Gi"})
        self.assertEqual(d.status_value["phase"], "Pending")
        observed = as_observed(d, "prod")
        observed[0]["status"] = {
            "phase": "Running",
            "readyReplicas": 3,
            "primaryEndpoint": "app-rw.prod.svc:5432",
            "observedGeneration": 1,
            "conditions": [{"type": "Ready", "reason": "AllInstancesReady", "message": "3 of 3 ready"}],
        }
        running = reconcile(PLUGIN, db(engine="postgresql", version="16", storage="5Gi", replicas=3), observed)
        self.assertEqual(
            running.status_value,
            {"engine": "postgresql", "version": "16.15", "phase": "Running", "readyReplicas": 3, "endpoint": "app-rw.prod.svc:5432"},
        )
        self.assertEqual(running.conditions[0].reason, "AllInstancesReady")
        self.assertIsNone(running.requeue_after_seconds)
        # Scaled: the cluster's Running is about the old spec until it reports again.
        scaled = reconcile(PLUGIN, db(engine="postgresql", version="16", storage="5Gi", replicas=5), observed)
        self.assertEqual(scaled.children[0]["spec"]["replicas"], 5)
        self.assertEqual(scaled.status_value["phase"], "Degraded")
        self.assertEqual(scaled.conditions[0].reason, "WaitingForCluster")


class MysqlTest(unittest.TestCase):
    def fresh(self):
        return reconcile(PLUGIN, db(engine="mysql", version="8.4", storage="2Gi"))

    def test_children_and_status(self):
        d = self.fresh()
        self.assertEqual(kinds(d), [("Secret", "app-credentials"), ("Service", "app"), ("StatefulSet", "app")])
        sts = d.child_named("StatefulSet", "app")
        self.assertEqual(sts["spec"]["template"]["spec"]["containers"][0]["image"], "mysql:8.4")
        self.assertEqual(sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"], "2Gi")
        self.assertEqual(d.status_value["endpoint"], "app.prod.svc.cluster.local")
        self.assertIn("CredentialsCreated", [e.reason for e in d.events])

    def test_the_pods_meet_the_restricted_pod_security_standard(self):
        pod = self.fresh().child_named("StatefulSet", "app")["spec"]["template"]["spec"]
        context = pod["securityContext"]
        self.assertIs(context["runAsNonRoot"], True)
        self.assertNotEqual(context["runAsUser"], 0)
        self.assertEqual(context["seccompProfile"], {"type": "RuntimeDefault"})
        for container in pod["containers"] + pod.get("initContainers", []):
            own = container["securityContext"]
            self.assertIs(own["allowPrivilegeEscalation"], False, container["name"])
            self.assertEqual(own["capabilities"], {"drop": ["ALL"]}, container["name"])
            self.assertNotIn("privileged", own)
        self.assertNotIn("hostNetwork", pod)
        self.assertFalse(any("hostPath" in v for v in pod.get("volumes", [])))

    def test_the_password_is_random_kept_and_never_shown(self):
        first, second = self.fresh(), self.fresh()
        password = base64.b64decode(first.children[0]["data"]["password"]).decode()
        self.assertEqual(len(password), 24)
        self.assertNotEqual(first.children[0]["data"], second.children[0]["data"])
        observed = as_observed(first, "prod")
        for _ in range(3):
            again = reconcile(PLUGIN, db(engine="mysql", version="8.4", storage="2Gi"), observed)
            self.assertEqual(again.children[0], first.children[0])
            self.assertNotIn("CredentialsCreated", [e.reason for e in again.events])
        public = repr((first.status_value, first.events, first.conditions, first.children[1:]))
        self.assertNotIn(password, public)

    def test_refusals_keep_every_child(self):
        first = self.fresh()
        observed = as_observed(first, "prod")
        for fields, reason in [
            ({"engine": "postgresql", "version": "16", "storage": "2Gi"}, "EngineChange"),
            ({"engine": "mysql", "version": "8.4", "storage": "4Gi"}, "StorageChange"),
            ({"engine": "mysql", "version": "8.0", "storage": "2Gi"}, "VersionDowngrade"),
        ]:
            out = reconcile(PLUGIN, db(**fields), observed)
            self.assertEqual(out.children, first.children, reason)
            self.assertEqual(out.status_value["phase"], "Failed")
            self.assertEqual(out.status_value["engine"], "mysql")
            self.assertEqual(out.conditions[0].reason, reason)
            self.assertEqual([(e.type, e.reason) for e in out.events], [("Warning", reason)])

    def test_a_newer_version_rolls(self):
        observed = as_observed(self.fresh(), "prod")
        out = reconcile(PLUGIN, db(engine="mysql", version="9.1", storage="2Gi"), observed)
        self.assertEqual(out.child_named("StatefulSet", "app")["spec"]["template"]["spec"]["containers"][0]["image"], "mysql:9.1")
        self.assertIn("VersionChanged", [e.reason for e in out.events])


class EngineChangeTest(unittest.TestCase):
    def test_recorded_engine_holds_without_children(self):
        out = reconcile(PLUGIN, db(status={"engine": "postgresql", "phase": "Running"}, engine="mysql"))
        self.assertEqual(out.children, [])
        self.assertEqual(out.status_value["phase"], "Failed")
        self.assertIn("set spec.engine back to postgresql", out.conditions[0].message)


class AdmissionTest(unittest.TestCase):
    """validate: an engine change is refused before it is stored, with reconcile's words."""

    def test_declares_validation_that_fails_closed_and_nothing_else_new(self):
        info = PLUGIN.describe()
        self.assertEqual(info.validation, FailurePolicy.FAIL)
        self.assertEqual((info.related, info.conversion, info.finalizer), ([], False, False))
        self.assertEqual(customize(PLUGIN, db(engine="mysql")), [])
        self.assertTrue(finalize(PLUGIN, db(engine="mysql")).done)
        with self.assertRaisesRegex(Refused, "does not convert"):
            convert(PLUGIN, db(engine="mysql"), "v1")

    def test_an_engine_change_is_refused_on_one_line(self):
        with self.assertRaises(Refused) as refused:
            validate(PLUGIN, db(engine="mysql", version="8.4"), db(engine="postgresql", version="16"))
        self.assertEqual(
            refused.exception.message,
            "spec.engine is postgresql, but this Database runs mysql: changing the engine needs a data "
            "migration, which this plugin does not do; set spec.engine back to mysql",
        )

    def test_validate_and_reconcile_refuse_with_the_same_words(self):
        running = as_observed(MysqlTest().fresh(), "prod")
        out = reconcile(PLUGIN, db(engine="postgresql", version="16", storage="2Gi"), running)
        with self.assertRaises(Refused) as refused:
            validate(PLUGIN, db(engine="mysql", version="8.4", storage="2Gi"), db(engine="postgresql", version="16"))
        self.assertEqual(out.conditions[0].reason, "EngineChange")
        self.assertEqual(out.conditions[0].message, f"{refused.exception.message}; nothing was changed")

    def test_what_does_not_change_the_engine_is_allowed(self):
        for old, new in [
            (None, db(engine="postgresql")),
            (None, db(engine="oracle", replicas=9)),
            (db(engine="mysql", version="8.4"), db(engine="mysql", version="9.1", storage="5Gi")),
            (db(engine="postgresql", replicas=1), db(engine="postgresql", replicas=3)),
            # Nothing recorded: the Database never named an engine, so nothing is fixed.
            (db(), db(engine="mysql")),
        ]:
            self.assertEqual(validate(PLUGIN, old, new), [], (old, new))

    def test_after_a_refused_change_got_in_setting_the_engine_back_is_allowed(self):
        # A change stored before the webhook served: the status still says what runs.
        stuck = db(status={"engine": "mysql", "phase": "Failed"}, engine="postgresql")
        self.assertEqual(validate(PLUGIN, stuck, db(engine="mysql")), [])
        # Updates that leave the engine as it was do not get stuck behind it.
        self.assertEqual(validate(PLUGIN, stuck, db(engine="postgresql", replicas=2)), [])
        with self.assertRaisesRegex(Refused, "^spec.engine is postgresql, but this Database runs mysql"):
            validate(PLUGIN, db(status={"engine": "mysql"}, engine="mysql"), db(engine="postgresql"))

    def test_removing_or_breaking_the_engine_is_refused_as_reconcile_refuses_it(self):
        with self.assertRaisesRegex(Refused, "^spec.engine is required: postgresql or mysql$"):
            validate(PLUGIN, db(engine="mysql"), db())
        with self.assertRaisesRegex(Refused, '^spec.engine "oracle" is not one of postgresql, mysql$'):
            validate(PLUGIN, db(engine="mysql"), db(engine="oracle"))

    def test_a_malformed_object_is_answered_not_crashed_on(self):
        weird = parent("mycompany.com/v1", "Database", name="app", namespace="prod")
        weird["spec"], weird["status"] = ["not", "an", "object"], "nor this"
        self.assertEqual(validate(PLUGIN, weird, weird), [])
        with self.assertRaisesRegex(Refused, "spec.engine is required"):
            validate(PLUGIN, db(engine="mysql"), weird)


if __name__ == "__main__":
    unittest.main()
