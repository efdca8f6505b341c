"""Fixtures shared by several test modules. `control_plane` (tests/k8s_testenv.py) is defined once
here so the whole session shares one real Kubernetes control plane."""

from k8s_testenv import control_plane  # noqa: F401 - a session fixture
