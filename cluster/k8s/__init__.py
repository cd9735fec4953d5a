"""The KubeRay manifests' generator: deploy settings, the RayService, overlay patches,
kustomize in Python, and ``cluster k8s``."""
