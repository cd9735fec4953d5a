"""The base of every typed file the cluster reads (the config, the demand file, the k8s settings):
pydantic v2 models whose unknown keys are errors, one YAML reader and one way to name a bad field.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from cluster.json_types import JSON


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


class ConfigError(Exception):
    """A config that cannot be used; the message names the file and the field."""


M = TypeVar("M", bound=BaseModel)


def read_yaml(
    path: str | os.PathLike[str], error: type[ConfigError] = ConfigError, expand_env: bool = False
) -> JSON:
    """The parsed document of a YAML file (``$VAR`` expanded first with ``expand_env``); a missing
    file or bad YAML is ``error`` naming the file."""
    p = Path(path)
    try:
        text = p.read_text()
        return yaml.safe_load(os.path.expandvars(text) if expand_env else text)
    except FileNotFoundError as exc:
        raise error(f"{p}: no such file") from exc
    except yaml.YAMLError as exc:
        raise error(f"{p}: not valid YAML: {exc}") from exc


def validate(model: type[M], raw: JSON, source: str, what: str, error: type[ConfigError] = ConfigError) -> M:
    """``raw`` (a mapping) as ``model``, or ``error`` naming ``source`` and each bad field."""
    if not isinstance(raw, dict):
        raise error(f"{source}: the top level must be a mapping, got {type(raw).__name__}")
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise error(f"{source}: invalid {what}:\n{format_validation_error(exc)}") from exc


def format_validation_error(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
        lines.append(f"  {loc}: {err['msg']}")
    return "\n".join(lines)
