"""Fixtures of the deploy tests: the Kubernetes overlays rendered once per module."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from .k8s_manifests import K8S, OVERLAYS, _kubectl_ok


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    if not _kubectl_ok():
        pytest.skip("kubectl is not installed here (needed for `kubectl kustomize`)")
    out = {}
    for overlay in OVERLAYS:
        run = subprocess.run(
            ["kubectl", "kustomize", str(K8S / "overlays" / overlay)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 0, run.stderr
        out[overlay] = [d for d in yaml.safe_load_all(run.stdout) if d]
    return out


@pytest.fixture(params=OVERLAYS)
def docs(request, rendered) -> list[dict]:
    return rendered[request.param]
