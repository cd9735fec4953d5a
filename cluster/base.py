"""The base of every config model: pydantic v2, unknown keys are errors that name the field."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)
