"""engine: postgresql - one PostgreSQLCluster (db.example.com/v1alpha1) of the same name,
reconciled by the PostgreSQL plugin; the Database mirrors its status."""

from typing import Optional

from capstan import Context, KindRef

from .spec import POSTGRESQL, Config
from .status import DEGRADED, PENDING, PHASES, Assessment

POSTGRESQL_CLUSTER = KindRef("db.example.com", "v1alpha1", "PostgreSQLCluster", "postgresqlclusters")
SPEC_FIELDS = ("replicas", "version", "storage")


def cluster(name: str, config: Config) -> dict:
    """The PostgreSQLCluster manifest for ``config``."""
    return {
        "apiVersion": POSTGRESQL_CLUSTER.api_version,
        "kind": POSTGRESQL_CLUSTER.kind,
        "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": name}},
        "spec": {"replicas": config.replicas, "version": config.version, "storage": config.storage},
    }


def observed(ctx: Context) -> Optional[dict]:
    """The observed PostgreSQLCluster of this Database."""
    return ctx.child(POSTGRESQL_CLUSTER, ctx.name)


def running(ctx: Context) -> Optional[Config]:
    """What the observed PostgreSQLCluster was built from, if there is one."""
    c = observed(ctx)
    if c is None:
        return None
    spec = c.get("spec") or {}
    try:
        return Config(POSTGRESQL, str(spec["version"]), str(spec["storage"]), int(spec["replicas"]))
    except (KeyError, TypeError, ValueError):
        return None


def kept(ctx: Context) -> list:
    """The observed PostgreSQLCluster as this plugin wrote it (its own fields only), to
    return unchanged when the spec is refused."""
    c = observed(ctx)
    if c is None:
        return []
    manifest = {
        "apiVersion": POSTGRESQL_CLUSTER.api_version,
        "kind": POSTGRESQL_CLUSTER.kind,
        "metadata": {"name": ctx.name, "labels": {"app.kubernetes.io/part-of": ctx.name}},
        "spec": {k: v for k, v in (c.get("spec") or {}).items() if k in SPEC_FIELDS},
    }
    return [manifest]


def assess(ctx: Context, wanted: Config) -> Assessment:
    """The Database's phase from the observed cluster's status, once the cluster has
    reported on the spec it is given now."""
    c = observed(ctx)
    name = ctx.name
    if c is None:
        return Assessment(PENDING, 0, "Creating", f"creating PostgreSQLCluster {name}")
    status = c.get("status") or {}
    ready = int(status.get("readyReplicas") or 0)
    endpoint = status.get("primaryEndpoint")
    spec = c.get("spec") or {}
    current = all(spec.get(k) == v for k, v in cluster(name, wanted)["spec"].items())
    generation = (c.get("metadata") or {}).get("generation")
    reported = status.get("observedGeneration") is not None and status.get("observedGeneration") == generation
    phase = status.get("phase")
    if not (current and reported) or phase not in PHASES:
        return Assessment(
            PENDING if ready == 0 else DEGRADED,
            ready,
            "WaitingForCluster",
            f"PostgreSQLCluster {name} has not reported on its latest spec yet",
            endpoint,
        )
    condition = next((x for x in status.get("conditions") or [] if x.get("type") == "Ready"), {})
    reason = condition.get("reason") or f"Cluster{phase}"
    message = f"PostgreSQLCluster {name}: {condition.get('message') or phase}"
    return Assessment(phase, ready, reason, message, endpoint)
