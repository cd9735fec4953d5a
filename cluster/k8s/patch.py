"""JSON merge patches (RFC 7386), how an overlay carries a whole other config, and the
deterministic YAML the generated manifests are written in."""

from __future__ import annotations

import copy

import yaml

from cluster.base import ConfigError
from cluster.json_types import JSON, JSONObject


def merge_patch(base: JSON, target: JSON) -> JSON:
    """The smallest patch that turns ``base`` into ``target``: maps merge, lists are replaced."""
    if not (isinstance(base, dict) and isinstance(target, dict)):
        return copy.deepcopy(target)
    patch: JSONObject = {k: None for k in base if k not in target}
    for k, v in target.items():
        if k not in base:
            patch[k] = copy.deepcopy(v)
        elif base[k] != v:
            patch[k] = merge_patch(base[k], v)
    return patch


def apply_merge_patch(base: JSON, patch: JSON) -> JSON:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(base) if isinstance(base, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = apply_merge_patch(out.get(k), v)
    return out


def rayservice_patch(base: JSONObject, target: JSONObject) -> JSONObject:
    """A kustomize patch for ``base`` (a RayService) that yields ``target``; identity kept."""
    if (base["apiVersion"], base["kind"], base["metadata"]["name"]) != (
        target["apiVersion"],
        target["kind"],
        target["metadata"]["name"],
    ):
        raise ConfigError("a patch must keep apiVersion, kind and metadata.name of its base")
    diff = merge_patch(base, target)
    diff.pop("apiVersion", None)
    diff.pop("kind", None)
    meta = diff.pop("metadata", {})
    meta["name"] = base["metadata"]["name"]
    return {"apiVersion": base["apiVersion"], "kind": base["kind"], "metadata": meta, **diff}


# YAML ----------------------------------------------------------------------------------------
class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _str)


def to_yaml(obj: JSON, header: str = "") -> str:
    """Deterministic YAML with multi-line strings (serveConfigV2) as literal blocks."""
    return header + yaml.dump(obj, Dumper=_Dumper, sort_keys=False, width=110, allow_unicode=True)
