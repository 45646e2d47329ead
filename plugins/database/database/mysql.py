"""engine: mysql - one MySQL instance: a StatefulSet on the official mysql image, a
headless Service of the Database's name, and a credentials Secret generated once.

MySQL replication is not implemented, so a mysql Database has exactly one instance
(spec.replicas > 1 is refused by spec.parse)."""

import base64
import binascii
from typing import Dict, List, Optional

from capstan import SECRET, SERVICE, STATEFUL_SET, Context, log, random

from .spec import MYSQL, Config
from .status import DEGRADED, PENDING, RUNNING, Assessment

PORT = 3306
PASSWORD_LENGTH = 24
USERNAME = "app"
DATABASE = "app"
# The mysql image's `mysql` user and group: the Pods run as them (the image's
# entrypoint then skips its root-only steps), so that they meet the `restricted`
# Pod Security Standard.
MYSQL_UID = 999
MYSQL_GID = 999
IMAGE = "mysql"


def secret_name(name: str) -> str:
    """The credentials Secret of Database ``name``."""
    return f"{name}-credentials"


def endpoint(ctx: Context) -> str:
    """Where clients connect (port 3306)."""
    return f"{ctx.name}.{ctx.namespace}.svc.cluster.local"


def labels(name: str) -> Dict[str, str]:
    """The labels of the instance's pods, also its selector."""
    return {"app.kubernetes.io/name": "mysql", "app.kubernetes.io/instance": name}


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def observed_credentials(ctx: Context) -> Optional[Dict[str, str]]:
    """The data (base64, as read) of the observed Secret, if it holds both passwords."""
    secret = ctx.child(SECRET, secret_name(ctx.name))
    if secret is None:
        return None
    data = secret.get("data") or {}
    try:
        for key in ("root-password", "password"):
            if not base64.b64decode(data[key], validate=True):
                return None
    except (KeyError, TypeError, binascii.Error):
        return None
    return dict(data)


def credentials(ctx: Context, desired) -> Dict[str, str]:
    """The Secret's data: the observed one when there is one, else new passwords (and a
    `CredentialsCreated` event). Passwords are never logged or put in the status."""
    data = observed_credentials(ctx)
    if data is not None:
        return data
    log.info(f"generated MySQL credentials for {ctx.namespace}/{ctx.name}")
    desired.event("CredentialsCreated", f"generated passwords in Secret {secret_name(ctx.name)}")
    return {
        "root-password": _b64(random.alphanumeric(PASSWORD_LENGTH)),
        "password": _b64(random.alphanumeric(PASSWORD_LENGTH)),
        "username": _b64(USERNAME),
        "database": _b64(DATABASE),
        "host": _b64(endpoint(ctx)),
        "port": _b64(str(PORT)),
    }


def secret(name: str, data: Dict[str, str]) -> dict:
    """The credentials Secret."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": secret_name(name), "labels": labels(name)},
        "type": "Opaque",
        "data": {k: data[k] for k in sorted(data)},
    }


def service(name: str) -> dict:
    """The headless Service: `<name>.<namespace>.svc.cluster.local` resolves to the
    ready instance, and names the StatefulSet's pods."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": labels(name)},
        "spec": {
            "clusterIP": "None",
            "selector": labels(name),
            "ports": [{"name": "mysql", "port": PORT, "targetPort": "mysql"}],
        },
    }


def _secret_env(env: str, name: str, key: str) -> dict:
    return {"name": env, "valueFrom": {"secretKeyRef": {"name": secret_name(name), "key": key}}}


def statefulset(name: str, config: Config) -> dict:
    """The StatefulSet of the one instance."""
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": name, "labels": labels(name)},
        "spec": {
            "replicas": config.replicas,
            "serviceName": name,
            "selector": {"matchLabels": labels(name)},
            "template": {
                "metadata": {"labels": labels(name)},
                "spec": {
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": MYSQL_UID,
                        "runAsGroup": MYSQL_GID,
                        "fsGroup": MYSQL_GID,
                        "fsGroupChangePolicy": "OnRootMismatch",
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "containers": [
                        {
                            "name": "mysql",
                            "image": f"{IMAGE}:{config.version}",
                            "ports": [{"name": "mysql", "containerPort": PORT}],
                            "env": [
                                _secret_env("MYSQL_ROOT_PASSWORD", name, "root-password"),
                                _secret_env("MYSQL_DATABASE", name, "database"),
                                _secret_env("MYSQL_USER", name, "username"),
                                _secret_env("MYSQL_PASSWORD", name, "password"),
                            ],
                            # mysqladmin ping succeeds whenever the server answers, even
                            # "access denied"; the entrypoint's temporary server during
                            # initialisation does not listen on TCP.
                            "readinessProbe": {
                                "exec": {"command": ["mysqladmin", "ping", "-h", "127.0.0.1", "--silent"]},
                                "periodSeconds": 10,
                                "timeoutSeconds": 5,
                            },
                            "livenessProbe": {
                                "tcpSocket": {"port": "mysql"},
                                "initialDelaySeconds": 120,
                                "periodSeconds": 20,
                            },
                            "resources": {
                                "requests": {"cpu": "250m", "memory": "512Mi"},
                                "limits": {"memory": "1Gi"},
                            },
                            "securityContext": {
                                "allowPrivilegeEscalation": False,
                                "capabilities": {"drop": ["ALL"]},
                            },
                            # A subdirectory: mysqld refuses to initialise a data
                            # directory that holds lost+found.
                            "volumeMounts": [{"name": "data", "mountPath": "/var/lib/mysql", "subPath": "mysql"}],
                        }
                    ],
                },
            },
            "volumeClaimTemplates": [
                {
                    "metadata": {"name": "data"},
                    "spec": {
                        "accessModes": ["ReadWriteOnce"],
                        "resources": {"requests": {"storage": config.storage}},
                    },
                }
            ],
        },
    }


def observed_statefulset(ctx: Context) -> Optional[dict]:
    """The observed StatefulSet of this Database."""
    return ctx.child(STATEFUL_SET, ctx.name)


def running(ctx: Context) -> Optional[Config]:
    """What the observed StatefulSet was built from, if there is one this plugin made."""
    sts = observed_statefulset(ctx)
    if sts is None:
        return None
    spec = sts.get("spec") or {}
    try:
        image = spec["template"]["spec"]["containers"][0]["image"]
        storage = spec["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"]
        replicas = int(spec.get("replicas", 1))
    except (KeyError, IndexError, TypeError, ValueError):
        return None
    prefix = f"{IMAGE}:"
    if not isinstance(image, str) or not image.startswith(prefix):
        return None
    return Config(MYSQL, image[len(prefix) :], str(storage), replicas)


def children(ctx: Context, config: Config, data: Dict[str, str]) -> List[dict]:
    """Every child of a mysql Database."""
    return [secret(ctx.name, data), service(ctx.name), statefulset(ctx.name, config)]


def kept(ctx: Context) -> List[dict]:
    """The observed children rebuilt as this plugin wrote them, to return unchanged when
    the spec is refused; None when the StatefulSet cannot be read back."""
    out = []
    data = observed_credentials(ctx)
    if data is not None:
        out.append(secret(ctx.name, data))
    if ctx.child(SERVICE, ctx.name) is not None:
        out.append(service(ctx.name))
    if observed_statefulset(ctx) is not None:
        config = running(ctx)
        if config is None:
            return None
        out.append(statefulset(ctx.name, config))
    return out


def assess(ctx: Context, wanted: Config, before: Optional[Config]) -> Assessment:
    """The Database's phase from the observed StatefulSet."""
    sts = observed_statefulset(ctx)
    where = endpoint(ctx)
    if sts is None:
        return Assessment(PENDING, 0, "Creating", f"creating MySQL {wanted.version}", where)
    status = sts.get("status") or {}
    ready = int(status.get("readyReplicas") or 0)
    want = wanted.replicas
    generation = (sts.get("metadata") or {}).get("generation") or 0
    rolled_out = (
        before == wanted
        and (status.get("observedGeneration") or 0) >= generation
        and status.get("replicas") == want
        and status.get("updatedReplicas") == want
        and status.get("currentRevision") is not None
        and status.get("currentRevision") == status.get("updateRevision")
    )
    if ready == 0:
        return Assessment(PENDING, 0, "NoInstanceReady", f"0 of {want} instances ready", where)
    if rolled_out and ready >= want:
        return Assessment(RUNNING, ready, "AllInstancesReady", f"MySQL {wanted.version} ready", where)
    return Assessment(
        DEGRADED, ready, "RollingOut", f"rolling out MySQL {wanted.version}; {ready} of {want} ready", where
    )
