"""The local backend honours the autocaching choice (issue 22): its workers keep their
preprocessed items in a node-local store the dataset's cache allocation goes to, read hits from
it (no source read, no deterministic stage) and go back to the mount when told source."""

from __future__ import annotations

import os
from pathlib import Path

from policies.types import ClusterCapacity
from scheduler.backends.base import BackendConfig
from scheduler.backends.local import LocalBackend, WorkConservingPusher
from scheduler.backends.local_worker import Worker, WorkerSpec
from scheduler.backends.preprocessed import PreprocessedStore, deterministic_stage, read_control


class _Manager:
    """The data manager's client as the pusher sees it: records what it is told."""

    def __init__(self):
        self.cache: dict[str, float] = {}

    def allocate_cache_size(self, dataset, nbytes):
        self.cache[dataset] = nbytes

    def allocate_remote_io(self, job_id, rate, workers=1):
        pass


def _worker(tmp: Path, store_dir: Path) -> Worker:
    src = tmp / "mnt"  # stands for the FUSE mount: _read opens files under it
    src.mkdir()
    for i in range(4):
        (src / f"img{i}.jpg").write_bytes(os.urandom(1000))
    spec = WorkerSpec(job_id="1", attempt=1, dataset="7-imagenet", source="file:///x", ideal_throughput=1e9, total_bytes=8000,
                      consumed_bytes=0, mountpoint=str(src), cache_dir=str(tmp / "c"), stats_file=str(tmp / "s"),
                      status_file=str(tmp / "st"), mount_log=str(tmp / "l"), silod_cmd=["silod"], preprocessed_dir=str(store_dir))
    return Worker(spec)


def test_backend_routes_the_allocation_and_workers_use_the_store(tmp_path):
    backend = LocalBackend(BackendConfig(capacity=ClusterCapacity(gpus=1, cache=1e9, remote_io=1e9), state_dir=tmp_path / "state"))
    manager = _Manager()
    pusher = WorkConservingPusher(manager, backend, total_io=1e9, interval=3600)
    try:
        key = "7-imagenet"
        worker = _worker(tmp_path, backend.preprocessed_dir / key)
        # Source caching (the default): the mount's cache gets the allocation; the worker reads the mount.
        pusher.allocate_cache_size(key, 5000.0)
        assert manager.cache[key] == 5000.0
        assert worker._read("img0.jpg") == 1000 and worker.status()["preprocessed"] == {"hits": 0, "misses": 0}
        # Preprocessed (expansion 2): the allocation goes to the store, the mount's cache gets 0.
        pusher.set_autocache(key, 2.0)
        pusher.allocate_cache_size(key, 5000.0)
        assert manager.cache[key] == 0.0
        control = read_control(backend.preprocessed_dir / key)
        assert (control.expansion, control.budget) == (2.0, 5000.0)
        worker._store._checked = -1e9  # the worker re-reads the control file once a second
        for i in range(4):  # epoch 1: misses; 2,000 bytes each decoded, room for two in 5,000
            assert worker._read(f"img{i}.jpg") == 1000
        store = PreprocessedStore(backend.preprocessed_dir / key)
        assert store.used() == 4000
        raw = (Path(worker.spec.mountpoint) / "img0.jpg").read_bytes()
        assert store.get("img0.jpg") == deterministic_stage(raw, 2.0)  # the stage's output, stored
        os.unlink(Path(worker.spec.mountpoint) / "img0.jpg")  # a hit must not touch the source
        assert worker._read("img0.jpg") == 2000
        assert worker.status()["preprocessed"] == {"hits": 1, "misses": 4}
        # A smaller allocation evicts to fit; back to source empties the store and re-routes.
        pusher.allocate_cache_size(key, 2500.0)
        assert store.used() == 2000
        pusher.set_autocache(key, 1.0)
        pusher.allocate_cache_size(key, 5000.0)
        assert manager.cache[key] == 5000.0 and store.used() == 0
        worker._store._checked = -1e9
        assert worker._read("img1.jpg") == 1000  # from the mount again
    finally:
        pusher.close()


def test_deterministic_stage_is_deterministic_and_sized():
    raw = os.urandom(3000)
    assert deterministic_stage(raw, 6.0) == deterministic_stage(raw, 6.0)
    assert len(deterministic_stage(raw, 6.0)) == 18000
    assert deterministic_stage(raw, 6.0) != deterministic_stage(os.urandom(3000), 6.0)


def test_storage_push_sends_the_choice_before_sizes_and_resends_the_size():
    from scheduler.service.storage_push import StoragePush

    calls = []

    class Pusher:
        def set_autocache(self, name, e):
            calls.append(("autocache", name, e))

        def allocate_cache_size(self, name, nbytes):
            calls.append(("cache", name, nbytes))

        def allocate_remote_io(self, job, rate):
            calls.append(("io", job, rate))

    push = StoragePush(Pusher())
    push.push({"d": 10.0}, {}, autocache={"d": 1.0})
    push.push({"d": 10.0}, {}, autocache={"d": 1.0})  # nothing changed: nothing sent
    push.push({"d": 10.0}, {}, autocache={"d": 6.0})  # the choice changed: choice, then the same size again
    assert calls == [("autocache", "d", 1.0), ("cache", "d", 10.0), ("autocache", "d", 6.0), ("cache", "d", 10.0)]
