"""The DynamoModel API as the code addresses it: group, versions, kind and names, defined once.

``crds/dynamomodel.yaml`` is the CRD itself (schema, validation, printer columns); this module is
what the operator, the router, the dev cluster and the tests import to name it (a test checks
that the two agree).
"""

from __future__ import annotations

from lorafleet_operator.kube import collection_path

GROUP = "nvidia.com"
VERSION = "v1alpha1"  # the storage version, and the one the operator and the router read and write
VERSIONS = ("v1alpha1", "v1beta1")  # both served, with one schema (NVIDIA Dynamo serves both)
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "DynamoModel"
PLURAL = "dynamomodels"
SINGULAR = "dynamomodel"
SHORT_NAMES = ("dm",)
CRD_NAME = f"{PLURAL}.{GROUP}"
FINALIZER = f"{GROUP}/finalizer"


def models_path(namespace: str | None = None, version: str = VERSION) -> str:
    """The DynamoModel collection: ``/apis/nvidia.com/v1alpha1/namespaces/NS/dynamomodels`` (all namespaces: None)."""
    return collection_path(GROUP, version, PLURAL, namespace)


def model_path(namespace: str, name: str, version: str = VERSION) -> str:
    """One DynamoModel: ``.../namespaces/NS/dynamomodels/NAME``."""
    return f"{models_path(namespace, version)}/{name}"


def object_reference(namespace: str, name: str, uid: str) -> dict[str, str]:
    """A reference to one DynamoModel (an Event's ``involvedObject``)."""
    return {"apiVersion": API_VERSION, "kind": KIND, "name": name, "namespace": namespace, "uid": uid}
