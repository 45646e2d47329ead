"""The Database plugin: seed 000's ``Database`` kind (``mycompany.com/v1``) as a Python
plugin. ``engine: postgresql`` becomes a PostgreSQLCluster that the PostgreSQL plugin
reconciles; ``engine: mysql`` becomes one MySQL instance (StatefulSet, Service, Secret).
See docs/database.md."""

from typing import List, Optional

from capstan import (
    SECRET,
    SERVICE,
    STATEFUL_SET,
    Context,
    Desired,
    FailurePolicy,
    Invalid,
    KindRef,
    Plugin,
    PluginInfo,
)

from . import mysql, postgresql
from .crd import CRD_JSON, GROUP, KIND, PLURAL, VERSION
from .spec import ENGINES, MYSQL, POSTGRESQL, Config, engine_of, parse, version_key
from .status import FAILED, RUNNING, Assessment, report

PLUGIN_VERSION = "0.1.0"
# How soon to look again while a Database converges, so the phase moves on even when no
# child changes.
REQUEUE_WHILE_CONVERGING = 10


class DatabasePlugin(Plugin):
    """Reconciles ``Database`` into the children of its engine."""

    def describe(self) -> PluginInfo:
        return PluginInfo(
            name="database",
            version=PLUGIN_VERSION,
            parent=KindRef(GROUP, VERSION, KIND, PLURAL),
            children=[postgresql.POSTGRESQL_CLUSTER, STATEFUL_SET, SERVICE, SECRET],
            crd=CRD_JSON,
            # An engine change is refused before it is stored; reconcile still refuses
            # one that got in (a Database older than the webhook).
            validation=FailurePolicy.FAIL,
        )

    def reconcile(self, ctx: Context) -> Desired:
        engine = engine_of(ctx.spec)
        before = running_engine(ctx)
        if before is not None and before != engine:
            return refuse(ctx, before, "EngineChange", engine_change(engine, before))
        wanted = parse(ctx.spec)
        if engine == POSTGRESQL:
            return reconcile_postgresql(ctx, wanted)
        return reconcile_mysql(ctx, wanted)

    def validate(self, old: Optional[dict], new: dict) -> List[str]:
        """Refuses a change of spec.engine at admission, with the message reconcile gives
        it. Setting it back to the engine that runs is allowed, and so is any update
        that leaves it as it was. Every other rule stays with reconcile, which reports
        it on the Database."""
        before = None if old is None else recorded_engine(old)
        asked = _field(new, "spec").get("engine")
        if before is None or asked in (before, _field(old, "spec").get("engine")):
            return []
        # A missing or unknown engine is refused as reconcile refuses it.
        raise Invalid(engine_change(engine_of(_field(new, "spec")), before))


def engine_change(engine: str, before: str) -> str:
    """Why a Database running ``before`` cannot move to ``engine``."""
    return (
        f"spec.engine is {engine}, but this Database runs {before}: changing the engine "
        f"needs a data migration, which this plugin does not do; set spec.engine back to {before}"
    )


def recorded_engine(database: dict) -> Optional[str]:
    """The engine a stored Database is fixed to: the one its status says runs (so that
    setting spec.engine back after a refused change is allowed), else its spec's."""
    for section in ("status", "spec"):
        engine = _field(database, section).get("engine")
        if engine in ENGINES:
            return engine
    return None


def _field(obj: dict, name: str) -> dict:
    value = obj.get(name)
    return value if isinstance(value, dict) else {}


def running_engine(ctx: Context):
    """The engine this Database runs: from its observed children, else from its status
    (children deleted by hand do not make another engine acceptable)."""
    if postgresql.observed(ctx) is not None:
        return POSTGRESQL
    if mysql.observed_statefulset(ctx) is not None or mysql.observed_credentials(ctx) is not None:
        return MYSQL
    return ctx.status.get("engine")


def reconcile_postgresql(ctx: Context, wanted: Config) -> Desired:
    desired = Desired().child(postgresql.cluster(ctx.name, wanted))
    finish(ctx, desired, wanted, postgresql.assess(ctx, wanted))
    return desired


def reconcile_mysql(ctx: Context, wanted: Config) -> Desired:
    before = mysql.running(ctx)
    if before is not None:
        if before.storage != wanted.storage:
            return refuse(
                ctx,
                MYSQL,
                "StorageChange",
                f"spec.storage {wanted.storage} differs from the {before.storage} the Database was created with: "
                f"a StatefulSet's volume claim templates cannot change; set spec.storage back to {before.storage}",
            )
        if version_key(wanted.version)[:2] < version_key(before.version)[:2]:
            return refuse(
                ctx,
                MYSQL,
                "VersionDowngrade",
                f"spec.version {wanted.version} is older than the running {before.version}: "
                f"MySQL does not support downgrades in place; set spec.version back to {before.version} or later",
            )
    desired = Desired()
    for child in mysql.children(ctx, wanted, mysql.credentials(ctx, desired)):
        desired.child(child)
    if before is not None and before.version != wanted.version:
        desired.event("VersionChanged", f"rolling MySQL from {before.version} to {wanted.version}")
    finish(ctx, desired, wanted, mysql.assess(ctx, wanted, before))
    return desired


def finish(ctx: Context, desired: Desired, wanted: Config, assessment: Assessment) -> None:
    report(ctx, desired, wanted.engine, wanted.version, assessment)
    if assessment.phase not in (RUNNING, FAILED):
        desired.requeue_after(REQUEUE_WHILE_CONVERGING)


def refuse(ctx: Context, engine: str, reason: str, why: str) -> Desired:
    """The spec cannot be applied: every child returned as it is (so the host changes
    and prunes nothing), phase Failed, and a Warning event."""
    message = f"{why}; nothing was changed"
    kept = postgresql.kept(ctx) if engine == POSTGRESQL else mysql.kept(ctx)
    if kept is None:
        # The children cannot be rebuilt as they are: Invalid applies and prunes nothing.
        raise Invalid(message)
    desired = Desired()
    for child in kept:
        desired.child(child)
    running = postgresql.running(ctx) if engine == POSTGRESQL else mysql.running(ctx)
    version = running.version if running else ctx.status.get("version", "")
    ready = int(ctx.status.get("readyReplicas") or 0)
    if engine == POSTGRESQL and postgresql.observed(ctx):
        ready = int((postgresql.observed(ctx).get("status") or {}).get("readyReplicas") or 0)
    elif engine == MYSQL and mysql.observed_statefulset(ctx):
        ready = int((mysql.observed_statefulset(ctx).get("status") or {}).get("readyReplicas") or 0)
    endpoint = ctx.status.get("endpoint")
    report(ctx, desired, engine, version, Assessment(FAILED, ready, reason, message, endpoint))
    return desired


__all__ = ["DatabasePlugin"]
