"""The Kubernetes manifests of ``examples/cluster/k8s/`` against the Kubernetes API schemas.

No Kubernetes cluster runs here. ``kubernetes-validate`` (the ``test`` extra) bundles the
OpenAPI-derived JSON schemas of every Kubernetes release and validates offline; each object of
every manifest is checked against the newest bundled release in *strict* mode (an unknown field,
e.g. a misspelt ``resources`` key, fails as well as a wrong type or a missing required field).
What this cannot check is what only a live cluster knows: that the image exists, that the storage
class supports ReadWriteMany, that the RBAC Role suffices for ``kubectl apply``.
"""

from __future__ import annotations

import copy
import socket
from pathlib import Path

import pytest
import yaml

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="the test extra: pip install -e '.[test]'")

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((ROOT / "examples" / "cluster" / "k8s").glob("*.yaml"))
#: the Kubernetes release validated against: the newest one the package bundles
VERSION = kubernetes_validate.latest_version()


def _objects(path: Path) -> list[dict]:
    """The objects of a manifest; the per-instance template as the autoscaler's launch command
    renders it (``sed 's/__INSTANCE__/{instance}/g'``, README), for instance ``raas-0``."""
    return [d for d in yaml.safe_load_all(path.read_text().replace("__INSTANCE__", "raas-0")) if d]


OBJECTS = [pytest.param(obj, id=f"{p.name}:{obj['kind']}/{obj['metadata']['name']}")
           for p in MANIFESTS for obj in _objects(p)]


@pytest.fixture
def no_network(monkeypatch):
    """Any connection attempt fails the test: the validation must be offline."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"kubernetes-validate tried to open a connection: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_every_manifest_has_objects():
    assert len(MANIFESTS) >= 7 and len(OBJECTS) >= 10


@pytest.mark.parametrize("obj", OBJECTS)
def test_manifest_object_is_valid_kubernetes(obj, no_network):
    validated = kubernetes_validate.validate(obj, VERSION, strict=True)
    assert VERSION.startswith(validated)  # the release whose schema was used, e.g. "1.37"


def _container(objects: list[dict]) -> dict:
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    return deployment["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("break_it, field", [
    (lambda c: c.__setitem__("resource", c.pop("resources")), "resource"),   # misspelt key
    (lambda c: c.__setitem__("args", "raas serve"), "args"),                 # a string, not a list
    (lambda c: c.pop("name"), "name"),                                       # required field
])
def test_a_broken_manifest_fails(break_it, field, no_network):
    """The check can fail: a misspelt field, a wrong type and a missing required field in the
    RaaS Deployment are each refused, naming the field."""
    objects = copy.deepcopy(_objects(ROOT / "examples" / "cluster" / "k8s" / "raas.yaml"))
    break_it(_container(objects))
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    with pytest.raises(kubernetes_validate.ValidationError) as info:
        kubernetes_validate.validate(deployment, VERSION, strict=True)
    assert field in str(info.value) or field in ".".join(map(str, info.value.path))
