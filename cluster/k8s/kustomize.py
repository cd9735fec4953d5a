"""`kustomize build` in pure Python, for the subset of kustomize that k8s/ uses, so that tests build
the overlays without kubectl (tests/unit/test_k8s.py compares with the real one where it exists).

Supported kustomization fields: `resources` (files, and folders built recursively), `namespace`,
`patches` with `path:` (strategic-merge patches) and `configMapGenerator` (`files`, with
`options.disableNameSuffixHash: true`, `labels`, `annotations`); any other field is an error that
names it. Semantics follow kustomize v5:

* Within a kustomization: its resources in order, then generated ConfigMaps, then the patches,
  then the namespace. `build` returns the documents in kustomize's default (legacy) order.
* A strategic-merge patch targets one resource by apiVersion, kind, metadata.name (and
  metadata.namespace when the patch has one). Maps merge recursively; `null` deletes a key;
  `$patch: delete` deletes a map, a list element or the whole resource, `$patch: replace` replaces
  a map. A list merges by its Kubernetes merge key (MERGE_KEYS) only in a built-in kind; kustomize
  has no schema for a custom resource (RayService, PodMonitor …), so there every list, even
  `containers` or `workerGroupSpecs`, is replaced whole, like a string such as `serveConfigV2`.
* `namespace` sets metadata.namespace on namespaced resources and renames a v1 Namespace. Not
  supported: RoleBinding subjects and the APIService/CRD webhook service namespaces.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from cluster.json_types import JSON, JSONObject

Doc = JSONObject

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
FIELDS = {"apiVersion", "kind", "resources", "namespace", "patches", "configMapGenerator"}
BUILTIN_GROUPS = {"", "apps", "batch", "autoscaling", "policy"} | {
    f"{g}.k8s.io"
    for g in (  # noqa: SIM905
        "networking rbac.authorization storage scheduling coordination discovery node certificates "
        "admissionregistration apiextensions apiregistration events"
    ).split()
}
# Merge keys of the lists of maps in built-in kinds (the Kubernetes patchMergeKey of the field).
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "volumes": "name",
    "env": "name",
    "imagePullSecrets": "name",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "hostAliases": "ip",
    "ports": "containerPort",  # "port" in a Service (_merge_key)
}
CLUSTER_SCOPED = (  # noqa: SIM905
    "Namespace Node PersistentVolume StorageClass CustomResourceDefinition ClusterRole ClusterRoleBinding "
    "PriorityClass MutatingWebhookConfiguration ValidatingWebhookConfiguration APIService CSIDriver CSINode "
    "RuntimeClass IngressClass VolumeAttachment CertificateSigningRequest PodSecurityPolicy FlowSchema "
    "PriorityLevelConfiguration ValidatingAdmissionPolicy ValidatingAdmissionPolicyBinding"
).split()
ORDER_FIRST = (  # noqa: SIM905
    "Namespace ResourceQuota StorageClass CustomResourceDefinition ServiceAccount PodSecurityPolicy "
    "Role ClusterRole RoleBinding ClusterRoleBinding ConfigMap Secret Endpoints Service LimitRange "
    "PriorityClass PersistentVolume PersistentVolumeClaim Deployment StatefulSet CronJob "
    "PodDisruptionBudget"
).split()
ORDER_LAST = ["MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"]
_DELETE = object()  # what a merge returns for a value that `null` or `$patch: delete` removes


class KustomizeError(ValueError):
    """A kustomization this module cannot build, or that kustomize itself would refuse."""


def build(path: str | os.PathLike[str]) -> list[Doc]:
    """The documents `kustomize build path` prints, in its order."""
    return sorted(_build(Path(path).resolve(), ()), key=_legacy_order)


def find(docs: list[Doc], kind: str, name: str | None = None) -> Doc:
    """The one document of `kind` (named `name`, if given); KeyError for none or several."""
    found = [d for d in docs if d.get("kind") == kind and (name is None or d["metadata"].get("name") == name)]
    if len(found) != 1:
        raise KeyError(f"{len(found)} documents of kind {kind}" + (f" named {name}" if name else ""))
    return found[0]


def strategic_merge(base: Doc, patch: Doc) -> Doc | None:
    """`base` with a strategic-merge `patch` applied (None: `$patch: delete` removed the resource)."""
    merged = _merge(base, patch, _group(base) in BUILTIN_GROUPS, "")
    return None if merged is _DELETE else merged


def _build(folder: Path, stack: tuple[Path, ...]) -> list[Doc]:
    if folder in stack:
        raise KustomizeError(f"cycle of kustomizations: {' -> '.join(map(str, (*stack, folder)))}")
    file = next((folder / n for n in KUSTOMIZATION_FILES if (folder / n).is_file()), None)
    if file is None:
        raise KustomizeError(f"{folder}: no kustomization.yaml")
    k = yaml.safe_load(file.read_text()) or {}
    if k.get("kind", "Kustomization") != "Kustomization" or set(k) - FIELDS:
        bad = sorted(set(k) - FIELDS) or [f"kind: {k['kind']}"]
        raise KustomizeError(f"{file}: unsupported kustomization field(s): {', '.join(bad)}")
    docs: list[Doc] = []
    for entry in k.get("resources") or []:
        p = folder / entry
        if p.is_dir():
            _add(docs, _build(p.resolve(), (*stack, folder)), file)
        elif p.is_file():
            _add(docs, _load(p), file)
        else:
            raise KustomizeError(f"{file}: resource {entry!r} is neither a file nor a folder")
    for gen in k.get("configMapGenerator") or []:
        _add(docs, [_config_map(folder, gen, file)], file)
    for entry in k.get("patches") or []:
        if bad := sorted(set(entry) - {"path"}):
            raise KustomizeError(f"{file}: unsupported patch field(s): {', '.join(bad)} (only path:)")
        for patch in _load(folder / entry["path"]):
            _apply(docs, patch, f"{file}: patch {entry['path']}")
    if ns := k.get("namespace"):
        for d in docs:
            if d["kind"] not in CLUSTER_SCOPED:
                d["metadata"]["namespace"] = ns
            elif d["kind"] == "Namespace" and d["apiVersion"] == "v1":
                d["metadata"]["name"] = ns
    return docs


def _load(path: Path) -> list[Doc]:
    docs = [_copy(d) for d in yaml.safe_load_all(path.read_text()) if d is not None]
    for d in docs:
        if not isinstance(d, dict) or not d.get("apiVersion") or not d.get("kind"):
            raise KustomizeError(f"{path}: not a Kubernetes object (a JSON 6902 patch?): {str(d)[:80]}")
        if not (d.get("metadata") or {}).get("name"):
            raise KustomizeError(f"{path}: a {d['kind']} without metadata.name")
        if d["kind"].endswith("List") and "items" in d:
            raise KustomizeError(f"{path}: unsupported: a {d['kind']} (list of objects)")
    return docs


def _add(docs: list[Doc], new: list[Doc], where: Path) -> None:
    for d in new:
        if any(_id(d) == _id(o) for o in docs):
            raise KustomizeError(f"{where}: may not add resource with an already registered id: {_id(d)}")
        docs.append(d)


def _config_map(folder: Path, gen: JSONObject, where: Path) -> Doc:
    opts = gen.get("options") or {}
    bad = sorted(set(gen) - {"name", "files", "options"}) + sorted(
        f"options.{o}" for o in set(opts) - {"disableNameSuffixHash", "labels", "annotations"}
    )
    if not opts.get("disableNameSuffixHash"):
        bad.append("options.disableNameSuffixHash unset (name hash suffixes)")
    if bad:
        raise KustomizeError(f"{where}: unsupported configMapGenerator field(s): {', '.join(bad)}")
    data: dict[str, str] = {}
    for spec in gen.get("files") or []:
        key, _, rel = spec.rpartition("=")
        key = key or Path(rel).name
        if key in data:
            raise KustomizeError(f"{where}: configMapGenerator {gen['name']}: key {key} twice")
        data[key] = (folder / rel).read_text()
    meta = {"name": gen["name"]} | {k: dict(opts[k]) for k in ("labels", "annotations") if opts.get(k)}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data}


def _apply(docs: list[Doc], patch: Doc, where: str) -> None:
    meta, want = patch["metadata"], (patch["apiVersion"], patch["kind"], patch["metadata"]["name"])
    targets = [
        i
        for i, d in enumerate(docs)
        if (d["apiVersion"], d["kind"], d["metadata"]["name"]) == want
        and meta.get("namespace", d["metadata"].get("namespace")) == d["metadata"].get("namespace")
    ]
    if len(targets) != 1:
        what = f"{patch['apiVersion']} {patch['kind']} {meta.get('namespace', '')}/{meta['name']}"
        raise KustomizeError(f"{where}: {len(targets)} resources match {what}, not one")
    merged = strategic_merge(docs[targets[0]], patch)
    if merged is None:
        del docs[targets[0]]
    else:
        docs[targets[0]] = merged


def _merge(base: JSON, patch: JSON, builtin: bool, field: str) -> JSON:
    if patch is None:
        return _DELETE
    if isinstance(patch, dict):
        patch = dict(patch)
        directive = patch.pop("$patch", None)
        bad = [k for k in patch if k.startswith("$")] + ([] if directive in _OK else [f"$patch: {directive}"])
        if bad:
            raise KustomizeError(f"unsupported patch directive(s) in {field or 'a patch'}: {', '.join(bad)}")
        if directive == "delete":
            return _DELETE
        if directive == "replace" or base is None:
            base = {}
        if not isinstance(base, dict):
            raise KustomizeError(f"{field}: a map patches a {type(base).__name__}")
        out = dict(base)
        for k, v in patch.items():
            if (m := _merge(out.get(k), v, builtin, k)) is _DELETE:
                out.pop(k, None)
            else:
                out[k] = m
        return out
    if isinstance(patch, list) and isinstance(base, list) and builtin and field in MERGE_KEYS:
        return _merge_list(base, patch, _merge_key(field, base + patch), field)
    if isinstance(base, dict) and base:
        raise KustomizeError(f"{field}: a {type(patch).__name__} patches a map")
    return _copy(patch)


_OK = (None, "merge", "delete", "replace")


def _merge_key(field: str, items: list[JSON]) -> str:
    if field == "ports" and not all(isinstance(i, dict) and "containerPort" in i for i in items):
        return "port"
    return MERGE_KEYS[field]


def _merge_list(base: list[JSON], patch: list[JSON], key: str, field: str) -> list[JSON]:
    """Kustomize's order: the patch's elements (merged into the base's of the same key), then the
    base's other elements."""
    if not all(isinstance(i, dict) and key in i for i in base + patch):
        raise KustomizeError(f"{field}: every element of a merged list needs its merge key {key}")
    by_key = {i[key]: i for i in base}
    out = [m for p in patch if (m := _merge(by_key.get(p[key]), p, True, field)) is not _DELETE]
    patched = {p[key] for p in patch}
    return out + [i for i in base if i[key] not in patched]


def _copy(node: JSON) -> JSON:
    """A deep copy that also un-shares YAML aliases (`*id001`), as kustomize does."""
    if isinstance(node, dict):
        return {k: _copy(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_copy(v) for v in node]
    return node


def _group(doc: Doc) -> str:
    group, _, _ = str(doc.get("apiVersion", "")).rpartition("/")
    return group


def _id(doc: Doc) -> tuple[str, str, str, str]:
    meta = doc["metadata"]
    return (doc["apiVersion"], doc["kind"], meta.get("namespace") or "", meta["name"])


def _legacy_order(doc: Doc) -> tuple[int, str, str, str]:
    kind, version = doc["kind"], str(doc["apiVersion"]).rpartition("/")[2]
    rank = ORDER_FIRST.index(kind) - len(ORDER_FIRST) if kind in ORDER_FIRST else 0
    rank = 1 + ORDER_LAST.index(kind) if kind in ORDER_LAST else rank
    gvk = f"{_group(doc) or '~G'}_{version or '~V'}_{kind}"
    return rank, gvk, doc["metadata"].get("namespace") or "~X", doc["metadata"]["name"]
