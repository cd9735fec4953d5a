# syntax=docker/dockerfile:1
# The project image that every pod of the RayService runs: Ray's own image, pinned to the Ray of
# rayClusterConfig.rayVersion (k8s/settings/*.yaml) and of pyproject's ray[serve]==2.60.*, with
# the project installed. Build (k8s/README.md):
#   GPU, production:   docker build -t registry.example.com/llm-cluster:0.1.0 .
#   CPU, kind + Locust: docker build --build-arg BASE_IMAGE=rayproject/ray:2.60.0-py311-cpu \
#                         --build-arg EXTRAS=serve,load -t llm-cluster:0.1.0-cpu .
ARG BASE_IMAGE=rayproject/ray:2.60.0-py311-gpu
FROM ${BASE_IMAGE}

# Extras of pyproject.toml to install: gpu (vLLM), or serve,load for the CPU image.
ARG EXTRAS=gpu
ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    LLMC_CACHE=/home/ray/.cache/llm-cluster
WORKDIR /home/ray/app

# Dependencies in a layer of their own: vLLM and torch weigh gigabytes and change rarely, the code
# changes often. Empty stand-in packages let pip resolve the project's extras without its sources.
# The versions are pinned by pyproject.toml's extras, which hadolint cannot see (DL3013).
COPY --chown=ray:users pyproject.toml ./
# hadolint ignore=DL3013
RUN mkdir -p cluster deployments \
    && touch cluster/__init__.py deployments/__init__.py \
    && pip install --no-cache-dir ".[${EXTRAS}]" \
    && rm -rf cluster deployments build ./*.egg-info

COPY --chown=ray:users cluster/ cluster/
COPY --chown=ray:users deployments/ deployments/
# The project itself; importing the Serve app builder here fails the build instead of the pods.
RUN pip install --no-cache-dir --no-deps --force-reinstall . \
    && rm -rf build ./*.egg-info \
    && python -c "import cluster.config, deployments.app"

# Configs for `serve run`/`config_path` use, and the locustfile for the in-cluster load test.
COPY --chown=ray:users configs/ configs/
COPY --chown=ray:users loadtest/ loadtest/
