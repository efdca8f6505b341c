"""Runnable examples shipped with the client (`python -m silod_client.examples.train_cnn`)."""
