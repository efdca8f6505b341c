"""Cluster backends: where jobs actually run. The interface is in `scheduler.backends.base`."""
