"""The CustomResourceDefinition of ``Database`` (``mycompany.com/v1``): seed 000's CRD
(group, names, scope and the four spec fields with their enum and bounds, nothing
added to them) with the status subresource, the status fields, printer columns and the
short name ``db``. ``crds/database.yaml`` is the same CRD as YAML; a test checks that
``capstan crd`` prints exactly it."""

import json

GROUP = "mycompany.com"
VERSION = "v1"
KIND = "Database"
PLURAL = "databases"

_CONDITION = {
    "type": "object",
    "required": ["type", "status", "lastTransitionTime", "reason", "message"],
    "properties": {
        "type": {"type": "string"},
        "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
        "reason": {"type": "string"},
        "message": {"type": "string"},
        "lastTransitionTime": {"type": "string", "format": "date-time"},
        "observedGeneration": {"type": "integer", "format": "int64"},
    },
}

CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {
        "name": f"{PLURAL}.{GROUP}",
        # Whose CRD this is: the plugin may install, update and convert it.
        "labels": {"capstan.dev/plugin": "database"},
    },
    "spec": {
        "group": GROUP,
        "scope": "Namespaced",
        "names": {
            "plural": PLURAL,
            "singular": "database",
            "kind": KIND,
            "listKind": "DatabaseList",
            "shortNames": ["db"],
        },
        "versions": [
            {
                "name": VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": [
                    {"name": "Engine", "type": "string", "jsonPath": ".spec.engine"},
                    {
                        "name": "Version",
                        "type": "string",
                        "description": "The engine version in use (a PostgreSQL major resolved to major.minor)",
                        "jsonPath": ".status.version",
                    },
                    {
                        "name": "Phase",
                        "type": "string",
                        "description": "Pending, Running, Degraded or Failed",
                        "jsonPath": ".status.phase",
                    },
                    {
                        "name": "Ready",
                        "type": "integer",
                        "description": "Instances that pass their readiness probe",
                        "jsonPath": ".status.readyReplicas",
                    },
                    {
                        "name": "Endpoint",
                        "type": "string",
                        "description": "Where clients connect",
                        "jsonPath": ".status.endpoint",
                    },
                    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                ],
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "properties": {
                                    "engine": {
                                        "type": "string",
                                        "enum": ["postgresql", "mysql"],
                                        "description": "Database engine. Cannot be changed once the Database runs.",
                                    },
                                    "version": {
                                        "type": "string",
                                        "description": 'Engine version. PostgreSQL: a major such as "16" (the plugin picks its pinned minor) or major.minor such as "16.4". MySQL: the tag of the official mysql image, such as "8.4".',
                                    },
                                    "storage": {
                                        "type": "string",
                                        "description": 'Size of each instance\'s volume, a Kubernetes quantity such as "100Gi" (default 10Gi). Cannot be changed once created.',
                                    },
                                    "replicas": {
                                        "type": "integer",
                                        "minimum": 1,
                                        "maximum": 5,
                                        "description": "Number of instances (default 1). MySQL: 1 only, replication is not implemented.",
                                    },
                                },
                            },
                            "status": {
                                "type": "object",
                                "properties": {
                                    "engine": {"type": "string"},
                                    "version": {"type": "string"},
                                    "phase": {
                                        "type": "string",
                                        "enum": ["Pending", "Running", "Degraded", "Failed"],
                                    },
                                    "readyReplicas": {"type": "integer"},
                                    "endpoint": {"type": "string"},
                                    "observedGeneration": {"type": "integer", "format": "int64"},
                                    "conditions": {
                                        "type": "array",
                                        "x-kubernetes-list-type": "map",
                                        "x-kubernetes-list-map-keys": ["type"],
                                        "items": _CONDITION,
                                    },
                                },
                            },
                        },
                    }
                },
            }
        ],
    },
}

CRD_JSON = json.dumps(CRD, separators=(",", ":"))
