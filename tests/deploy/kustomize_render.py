"""A small pure-Python `kustomize build` for the subset deploy/k8s uses, so tests see the
manifests an overlay really produces without the kustomize binary.

Supported kustomization fields (anything else raises, so the subset cannot silently drift):
resources (files and directories), namespace, images, replicas, patches (JSON 6902 operations
with a kind/name target), configMapGenerator and secretGenerator (files, literals) with
generatorOptions (labels; disableNameSuffixHash must be true: no hash-suffix renaming is done).
Order as in kustomize: resources and generators, then namespace, images, replicas, patches.
"""

from __future__ import annotations

import base64
import copy
from pathlib import Path
from typing import Any

import yaml

SUPPORTED = {"apiVersion", "kind", "resources", "namespace", "images", "replicas", "patches",
             "configMapGenerator", "secretGenerator", "generatorOptions"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                  "PersistentVolume", "StorageClass", "PriorityClass", "APIService"}
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}


class KustomizeError(ValueError):
    pass


def kustomization(directory: Path) -> dict[str, Any]:
    path = directory / "kustomization.yaml"
    if not path.is_file():
        raise KustomizeError(f"{directory}: no kustomization.yaml")
    data = yaml.safe_load(path.read_text()) or {}
    if unknown := set(data) - SUPPORTED:
        raise KustomizeError(f"{path}: fields this renderer does not support: {sorted(unknown)}")
    return data


def build(directory: Path) -> list[dict[str, Any]]:
    """The resources `kustomize build directory` would print, in order."""
    directory = directory.resolve()
    k = kustomization(directory)
    out: list[dict[str, Any]] = []
    for entry in k.get("resources", []):
        path = (directory / entry).resolve()
        if path.is_dir():
            out.extend(build(path))
        elif path.is_file():
            out.extend(doc for doc in yaml.safe_load_all(path.read_text()) if doc)
        else:
            raise KustomizeError(f"{directory}: resource {entry} does not exist")
    out.extend(_generated(directory, k))
    if namespace := k.get("namespace"):
        for doc in out:
            if doc["kind"] not in CLUSTER_SCOPED:
                doc.setdefault("metadata", {})["namespace"] = namespace
    for image in k.get("images", []):
        for container in _containers(out):
            _set_image(container, image)
    for replicas in k.get("replicas", []):
        targets = [d for d in out if d["metadata"]["name"] == replicas["name"]
                   and d["kind"] in WORKLOADS - {"DaemonSet", "Job"}]
        if not targets:
            raise KustomizeError(f"{directory}: replicas for unknown {replicas['name']}")
        for doc in targets:
            doc["spec"]["replicas"] = replicas["count"]
    for patch in k.get("patches", []):
        _apply_patch(directory, out, patch)
    _check_unique(directory, out)
    return out


def _generated(directory: Path, k: dict[str, Any]) -> list[dict[str, Any]]:
    options = k.get("generatorOptions", {})
    out = []
    for field, kind in (("configMapGenerator", "ConfigMap"), ("secretGenerator", "Secret")):
        for gen in k.get(field, []):
            if not options.get("disableNameSuffixHash") and not (gen.get("options") or {}).get(
                    "disableNameSuffixHash"):
                raise KustomizeError(f"{directory}: {gen['name']}: set disableNameSuffixHash "
                                     "(name-hash renaming is not rendered here)")
            data: dict[str, str] = {}
            for item in gen.get("files", []):
                key, _, source = item.rpartition("=")
                path = directory / source
                if not path.resolve().is_relative_to(directory):
                    raise KustomizeError(f"{directory}: {source} is outside the kustomization "
                                         "root (kustomize refuses to load it)")
                data[key or Path(source).name] = path.read_text()
            for item in gen.get("literals", []):
                key, _, value = item.partition("=")
                data[key] = value
            metadata = {"name": gen["name"]}
            if gen.get("namespace"):
                metadata["namespace"] = gen["namespace"]
            if labels := {**options.get("labels", {}), **gen.get("labels", {})}:
                metadata["labels"] = labels
            doc = {"apiVersion": "v1", "kind": kind, "metadata": metadata}
            if kind == "Secret":
                doc["type"] = gen.get("type", "Opaque")
                doc["data"] = {key: base64.b64encode(v.encode()).decode()
                               for key, v in data.items()}
            else:
                doc["data"] = data
            out.append(doc)
    return out


def _containers(docs: list[dict[str, Any]]):
    for doc in docs:
        spec = pod_spec(doc)
        if spec:
            yield from spec.get("initContainers", [])
            yield from spec.get("containers", [])


def pod_spec(doc: dict[str, Any]) -> dict[str, Any] | None:
    if doc["kind"] in WORKLOADS:
        return doc["spec"]["template"]["spec"]
    if doc["kind"] == "Pod":
        return doc["spec"]
    return None


def _set_image(container: dict[str, Any], image: dict[str, Any]) -> None:
    name = container["image"]
    base = name.split("@")[0]
    base = base.rsplit(":", 1)[0] if ":" in base.rsplit("/", 1)[-1] else base
    if base != image["name"]:
        return
    new = image.get("newName", base)
    if "digest" in image:
        container["image"] = f"{new}@{image['digest']}"
    elif "newTag" in image:
        container["image"] = f"{new}:{image['newTag']}"
    else:
        container["image"] = new + name[len(base):]


def _apply_patch(directory: Path, docs: list[dict[str, Any]], patch: dict[str, Any]) -> None:
    target = patch.get("target") or {}
    ops = yaml.safe_load(patch["patch"]) if "patch" in patch else yaml.safe_load(
        (directory / patch["path"]).read_text())
    if not isinstance(ops, list):
        raise KustomizeError(f"{directory}: only JSON 6902 patches (a list of operations) "
                             "are rendered here")
    matched = [d for d in docs if d["kind"] == target.get("kind", d["kind"])
               and d["metadata"]["name"] == target.get("name", d["metadata"]["name"])]
    if not matched:
        raise KustomizeError(f"{directory}: patch target {target} matches nothing")
    for doc in matched:
        for op in ops:
            json_patch(doc, op)


def json_patch(doc: Any, op: dict[str, Any]) -> None:
    """One RFC 6902 add/remove/replace operation, in place."""
    *parents, last = [p.replace("~1", "/").replace("~0", "~")
                      for p in op["path"].lstrip("/").split("/")]
    node = doc
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    kind = op["op"]
    if isinstance(node, list):
        index = len(node) if last == "-" else int(last)
        if kind == "add":
            node.insert(index, copy.deepcopy(op["value"]))
        elif kind == "remove":
            del node[index]
        elif kind == "replace":
            node[index] = copy.deepcopy(op["value"])
        else:
            raise KustomizeError(f"unsupported op {kind}")
        return
    if kind in ("remove", "replace") and last not in node:
        raise KustomizeError(f"{op['op']} {op['path']}: no such path")
    if kind == "remove":
        del node[last]
    elif kind in ("add", "replace"):
        node[last] = copy.deepcopy(op["value"])
    else:
        raise KustomizeError(f"unsupported op {kind}")


def _check_unique(directory: Path, docs: list[dict[str, Any]]) -> None:
    seen = set()
    for doc in docs:
        key = (doc["kind"], doc["metadata"].get("namespace"), doc["metadata"]["name"])
        if key in seen:
            raise KustomizeError(f"{directory}: {key} defined twice")
        seen.add(key)
