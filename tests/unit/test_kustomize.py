"""cluster.k8s.kustomize, the pure-Python `kustomize build`: the merge rules on small inline documents.
Where a kustomize or kubectl binary is on PATH, every build is also compared with the real one."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster.k8s.kustomize import KustomizeError, build, find, strategic_merge

KZ = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization"}
BINARY = (["kustomize", "build"] if shutil.which("kustomize") else None) or (
    ["kubectl", "kustomize"] if shutil.which("kubectl") else None
)


def real_build(path: Path) -> list[dict[str, Any]]:
    assert BINARY is not None
    out = subprocess.run([*BINARY, str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def write(folder: Path, kustomization: dict[str, Any], **files: Any) -> Path:
    """A kustomization in `folder`, and files (`base_yaml` for base.yaml): a document, a list of
    them, or text."""
    for name, content in {"kustomization.yaml": KZ | kustomization, **files}.items():
        path = folder / name.replace("_yaml", ".yaml")
        path.parent.mkdir(parents=True, exist_ok=True)
        docs = content if isinstance(content, list) else [content]
        path.write_text(content if isinstance(content, str) else yaml.safe_dump_all(docs, sort_keys=False))
    return folder


def built(folder: Path) -> list[dict[str, Any]]:
    """Our build, checked against the real kustomize's where one is installed."""
    ours = build(folder)
    if BINARY is not None:
        assert ours == real_build(folder)
    return ours


def deployment(**spec: Any) -> dict[str, Any]:
    pod = {"containers": [{"name": "app", "image": "app:1"}]} | spec
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web", "labels": {"a": "1", "b": "2"}},
        "spec": {"replicas": 2, "template": {"spec": pod}},
    }


def patch_of(doc: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": doc["apiVersion"],
        "kind": doc["kind"],
        "metadata": {"name": doc["metadata"]["name"]},
    } | spec


def overlay(tmp_path: Path, base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    write(
        tmp_path,
        {"resources": ["base.yaml"], "patches": [{"path": "patch.yaml"}]},
        base_yaml=base,
        patch_yaml=patch,
    )
    (doc,) = built(tmp_path)
    return doc


def test_maps_merge_recursively_and_null_deletes(tmp_path: Path) -> None:
    base = deployment()
    patch = patch_of(
        base, metadata={"name": "web", "labels": {"b": "3", "c": "4"}, "annotations": {"x": "y"}}
    )
    patch["spec"] = {"replicas": None, "template": {"metadata": {"labels": {"app": "web"}}}}
    doc = overlay(tmp_path, base, patch)
    assert doc["metadata"] == {
        "name": "web",
        "labels": {"a": "1", "b": "3", "c": "4"},
        "annotations": {"x": "y"},
    }
    assert "replicas" not in doc["spec"]
    assert doc["spec"]["template"] == {
        "metadata": {"labels": {"app": "web"}},
        "spec": base["spec"]["template"]["spec"],
    }


def test_lists_of_a_builtin_kind_merge_by_their_key(tmp_path: Path) -> None:
    app = {
        "name": "app",
        "image": "app:1",
        "ports": [{"containerPort": 80, "name": "http"}, {"containerPort": 9090, "name": "metrics"}],
        "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}],
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    }
    base = deployment(containers=[app, {"name": "side", "image": "side:1"}], volumes=[{"name": "data"}])
    pod = {
        "containers": [
            {
                "name": "app",
                "image": "app:2",
                "ports": [{"containerPort": 9090, "name": "prom"}],
                "env": [{"name": "B", "value": "two"}, {"name": "C", "value": "3"}],
                "volumeMounts": [{"name": "cache", "mountPath": "/cache"}],
            },
            {"name": "new", "image": "new:1"},
        ],
        "volumes": [{"name": "cache", "emptyDir": {}}],
    }
    doc = overlay(tmp_path, base, patch_of(base, spec={"template": {"spec": pod}}))
    spec = doc["spec"]["template"]["spec"]
    # kustomize's order: the patch's elements first, then the base's others.
    assert [c["name"] for c in spec["containers"]] == ["app", "new", "side"]
    merged = spec["containers"][0]
    assert merged["image"] == "app:2"
    assert merged["ports"] == [{"containerPort": 9090, "name": "prom"}, {"containerPort": 80, "name": "http"}]
    assert merged["env"] == [
        {"name": "B", "value": "two"},
        {"name": "C", "value": "3"},
        {"name": "A", "value": "1"},
    ]
    assert [m["mountPath"] for m in merged["volumeMounts"]] == ["/cache", "/data"]
    assert spec["volumes"] == [{"name": "cache", "emptyDir": {}}, {"name": "data"}]


def test_other_lists_are_replaced(tmp_path: Path) -> None:
    base = deployment(tolerations=[{"key": "a", "operator": "Exists"}], nodeSelector={"x": "1"})
    base["spec"]["template"]["spec"]["containers"][0]["args"] = ["--a", "--b"]
    pod = {
        "tolerations": [{"key": "b", "operator": "Exists"}],
        "containers": [{"name": "app", "args": ["--c"]}],
    }
    spec = overlay(tmp_path, base, patch_of(base, spec={"template": {"spec": pod}}))["spec"]["template"][
        "spec"
    ]
    assert spec["tolerations"] == [{"key": "b", "operator": "Exists"}]
    assert spec["containers"] == [{"name": "app", "image": "app:1", "args": ["--c"]}]


def test_a_custom_resource_has_no_merge_keys_so_its_lists_are_replaced(tmp_path: Path) -> None:
    """As kustomize does without a schema for the kind: the cpu-dev overlay drops the GPU group so."""
    groups = [
        {
            "groupName": "cpu",
            "replicas": 2,
            "template": {"spec": {"containers": [{"name": "w", "image": "i"}]}},
        },
        {"groupName": "gpu", "replicas": 2},
    ]
    base = {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": "llm"},
        "spec": {
            "serveConfigV2": "applications:\n- name: a\n",
            "rayClusterConfig": {"workerGroupSpecs": groups},
        },
    }
    patch = patch_of(base, spec={"serveConfigV2": "applications: []\n"})
    patch["spec"]["rayClusterConfig"] = {"workerGroupSpecs": [{"groupName": "cpu", "replicas": 1}]}
    doc = overlay(tmp_path, base, patch)
    assert doc["spec"] == {
        "serveConfigV2": "applications: []\n",
        "rayClusterConfig": {"workerGroupSpecs": [{"groupName": "cpu", "replicas": 1}]},
    }


def test_patch_delete_directive(tmp_path: Path) -> None:
    base = deployment(containers=[{"name": "app"}, {"name": "side"}], securityContext={"runAsUser": 1})
    pod = {"containers": [{"name": "side", "$patch": "delete"}], "securityContext": {"$patch": "delete"}}
    spec = overlay(tmp_path, base, patch_of(base, spec={"template": {"spec": pod}}))["spec"]["template"][
        "spec"
    ]
    assert spec == {"containers": [{"name": "app"}]}
    assert strategic_merge(base, patch_of(base, **{"$patch": "delete"})) is None


def test_namespace_goes_on_namespaced_resources_only(tmp_path: Path) -> None:
    docs = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "old"}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": "r"}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "namespace": "other"}},
        {"apiVersion": "ray.io/v1", "kind": "RayService", "metadata": {"name": "llm"}},
    ]
    out = built(write(tmp_path, {"namespace": "prod", "resources": ["all.yaml"]}, all_yaml=docs))
    assert [(d["kind"], d["metadata"].get("namespace")) for d in out] == [
        ("Namespace", None),  # renamed instead, as kustomize does
        ("ClusterRole", None),
        ("ConfigMap", "prod"),
        ("RayService", "prod"),
    ]
    assert find(out, "Namespace")["metadata"]["name"] == "prod"


def test_folders_generator_and_kustomize_order(tmp_path: Path) -> None:
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j"}}
    pvc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "p"}}
    write(tmp_path / "base", {"resources": ["job.yaml"]}, job_yaml=job)
    gen = {"name": "dash", "files": ["d.json", "renamed.json=d.json"]}
    gen["options"] = {"disableNameSuffixHash": True, "labels": {"grafana": "1"}, "annotations": {"f": "LLM"}}
    (tmp_path / "d.json").write_text('{"a": 1}\n')
    write(
        tmp_path,
        {"namespace": "dev", "resources": ["base", "pvc.yaml"], "configMapGenerator": [gen]},
        pvc_yaml=pvc,
    )
    docs = built(tmp_path)
    assert [d["kind"] for d in docs] == ["ConfigMap", "PersistentVolumeClaim", "Job"]
    cm = find(docs, "ConfigMap", "dash")
    assert cm["data"] == {"d.json": '{"a": 1}\n', "renamed.json": '{"a": 1}\n'}
    assert cm["metadata"] == {
        "name": "dash",
        "labels": {"grafana": "1"},
        "annotations": {"f": "LLM"},
        "namespace": "dev",
    }


def test_yaml_aliases_are_unshared(tmp_path: Path) -> None:
    text = "apiVersion: ray.io/v1\nkind: RayService\nmetadata: {name: llm}\nspec:\n  a: &x {k: 1}\n  b: *x\n"
    patch = {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": "llm"},
        "spec": {"a": {"k": 2}},
    }
    assert overlay(tmp_path, text, patch)["spec"] == {"a": {"k": 2}, "b": {"k": 1}}


@pytest.mark.parametrize(
    ("kustomization", "message"),
    [
        ({"images": [{"name": "a", "newTag": "2"}]}, "unsupported kustomization field.*images"),
        ({"commonLabels": {"a": "b"}}, "commonLabels"),
        ({"kind": "Component"}, "kind: Component"),
        ({"patches": [{"path": "p.yaml", "target": {"kind": "Job"}}]}, "unsupported patch field.*target"),
        ({"configMapGenerator": [{"name": "c", "literals": ["a=b"]}]}, "literals"),
        ({"configMapGenerator": [{"name": "c", "files": ["p.yaml"]}]}, "disableNameSuffixHash"),
        ({"resources": ["missing.yaml"]}, "neither a file nor a folder"),
    ],
)
def test_an_unsupported_field_is_an_error_naming_it(
    tmp_path: Path, kustomization: dict, message: str
) -> None:
    write(tmp_path, kustomization, p_yaml=deployment())
    with pytest.raises(KustomizeError, match=message):
        build(tmp_path)


def test_a_patch_must_match_a_resource_and_ids_be_unique(tmp_path: Path) -> None:
    other = patch_of(deployment()) | {"metadata": {"name": "other"}}
    write(
        tmp_path,
        {"resources": ["d.yaml"], "patches": [{"path": "p.yaml"}]},
        d_yaml=deployment(),
        p_yaml=other,
    )
    with pytest.raises(KustomizeError, match="0 resources match apps/v1 Deployment /other"):
        build(tmp_path)
    write(tmp_path, {"resources": ["d.yaml", "e.yaml"]}, e_yaml=deployment())
    with pytest.raises(KustomizeError, match="already registered id"):
        build(tmp_path)
    with pytest.raises(KustomizeError, match=r"directive.*\$retainKeys"):
        strategic_merge(deployment(), patch_of(deployment(), spec={"$retainKeys": ["replicas"]}))


def test_find() -> None:
    docs = [deployment(), patch_of(deployment()) | {"metadata": {"name": "b"}}]
    assert find(docs, "Deployment", "b") is docs[1]
    with pytest.raises(KeyError, match="2 documents of kind Deployment"):
        find(docs, "Deployment")
    with pytest.raises(KeyError, match="0 documents of kind Job"):
        find(docs, "Job")
