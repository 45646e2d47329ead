"""The Database spec, checked: engine, version (with the PostgreSQL version rule),
storage and replicas, and what each engine accepts."""

import json
import re
from dataclasses import dataclass

from capstan import Invalid

POSTGRESQL = "postgresql"
MYSQL = "mysql"
ENGINES = (POSTGRESQL, MYSQL)

MIN_REPLICAS = 1
MAX_REPLICAS = 5
DEFAULT_REPLICAS = 1
DEFAULT_STORAGE = "10Gi"
DEFAULT_VERSION = {POSTGRESQL: "17", MYSQL: "8.4"}

# The version rule: PostgreSQLCluster wants major.minor (the tag of the official
# postgres image). A major alone means the minor this plugin version pins for it, the
# latest release when the plugin was written; a newer plugin may pin a newer minor,
# which rolls the instances. Write major.minor to choose the minor yourself.
POSTGRESQL_MINORS = {
    13: "13.22",
    14: "14.19",
    15: "15.14",
    16: "16.15",
    17: "17.6",
    18: "18.0",
}
MIN_MYSQL_MAJOR = 8

_MAJOR = re.compile(r"^[0-9]+$")
_MAJOR_MINOR = re.compile(r"^[0-9]+\.[0-9]+$")
_MYSQL_TAG = re.compile(r"^[0-9]+(\.[0-9]+){0,2}$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")


def _q(value) -> str:
    """A value quoted as in the manifest (JSON), for messages."""
    return json.dumps(value)


@dataclass(frozen=True)
class Config:
    """What the children are built from: the spec once checked, or what runs."""

    engine: str
    version: str
    """PostgreSQL: major.minor; MySQL: the image tag."""
    storage: str
    replicas: int


def engine_of(spec: dict) -> str:
    """``spec.engine``, which must be one of :data:`ENGINES`."""
    engine = spec.get("engine")
    if engine is None:
        raise Invalid("spec.engine is required: postgresql or mysql")
    if engine not in ENGINES:
        raise Invalid(f"spec.engine {_q(engine)} is not one of postgresql, mysql")
    return engine


def parse(spec: dict) -> Config:
    """The configuration ``spec`` asks for. Whatever the CRD would refuse, and whatever
    the engine cannot do, is :class:`~capstan.Invalid`."""
    engine = engine_of(spec)
    replicas = spec.get("replicas", DEFAULT_REPLICAS)
    if not isinstance(replicas, int) or isinstance(replicas, bool):
        raise Invalid(f"spec.replicas {_q(replicas)} is not an integer")
    if not MIN_REPLICAS <= replicas <= MAX_REPLICAS:
        raise Invalid(f"spec.replicas is {replicas}; it must be between {MIN_REPLICAS} and {MAX_REPLICAS}")
    storage = spec.get("storage", DEFAULT_STORAGE)
    if not isinstance(storage, str) or not _QUANTITY.match(storage.strip()):
        raise Invalid(f'spec.storage {_q(storage)} is not a Kubernetes quantity such as "10Gi"')
    version = spec.get("version", DEFAULT_VERSION[engine])
    if not isinstance(version, str):
        raise Invalid(f"spec.version {_q(version)} is not a string: quote it, as in version: \"16\"")
    if engine == POSTGRESQL:
        version = postgresql_version(version.strip())
    else:
        version = mysql_version(version.strip())
        if replicas > 1:
            raise Invalid(
                f"spec.replicas is {replicas}, but a mysql Database runs one instance: "
                "MySQL replication is not implemented; set spec.replicas to 1, or use engine postgresql"
            )
    return Config(engine, version, storage.strip(), replicas)


def postgresql_version(version: str) -> str:
    """The PostgreSQLCluster version for ``spec.version``: a supported major becomes its
    pinned minor, major.minor of a supported major stays as written."""
    supported = f"{min(POSTGRESQL_MINORS)} to {max(POSTGRESQL_MINORS)}"
    if _MAJOR.match(version):
        major = int(version)
    elif _MAJOR_MINOR.match(version):
        major = int(version.split(".")[0])
    else:
        raise Invalid(f'spec.version {_q(version)} is not a PostgreSQL major ("16") or major.minor ("16.4")')
    if major not in POSTGRESQL_MINORS:
        raise Invalid(f"spec.version {_q(version)}: this plugin runs PostgreSQL {supported}")
    return POSTGRESQL_MINORS[major] if _MAJOR.match(version) else version


def mysql_version(version: str) -> str:
    """The mysql image tag for ``spec.version``: 8 or later, such as ``8.4`` or ``9.1.0``."""
    if not _MYSQL_TAG.match(version):
        raise Invalid(f'spec.version {_q(version)} is not a MySQL version such as "8.4"')
    if int(version.split(".")[0]) < MIN_MYSQL_MAJOR:
        raise Invalid(f"spec.version {_q(version)}: this plugin runs MySQL {MIN_MYSQL_MAJOR}.0 and later")
    return version


def version_key(version: str):
    """A version as a tuple of numbers, for comparisons."""
    return tuple(int(p) for p in version.split("."))
