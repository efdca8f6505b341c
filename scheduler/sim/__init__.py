"""The trace-driven simulator: a backend of the scheduling core (engine, with its cache-system
models and per-job readers), the paper's experiments and the `silod simulate|experiment` commands."""
