"""The node's dataset mounts and the pods' bind mounts of them (what the CSI Node service does).

- One FUSE mount (`silod mount --allow-other`, a child process) per (tenant, dataset) on the
  node, at `<state>/mounts/<tenant>/<dataset>`, caching into `<state>/cache/<tenant>` (on the
  node's disk: it survives agent restarts, so a restarted agent serves cached items without
  fetching them again). It lives while at least one published volume uses it.
- Per publication, a read-only bind mount of that FUSE mount at kubelet's target path. The driver
  has no STAGE_UNSTAGE capability, so kubelet calls NodePublishVolume once per pod: one volume
  (a PVC's, same volume_id) is published at as many target paths as pods on the node use it (the
  CSI spec allows it for MULTI_NODE_READER_ONLY). Publications are keyed by (volume_id,
  target_path); the dataset mount is reference-counted by them and released after the last.
- `<state>/volumes.json` records the publications, so that a restarted agent re-creates
  the dataset mounts and repairs the pods' bind mounts (a bind of a dead FUSE mount answers
  ENOTCONN) instead of leaving running pods without data.

Only this module runs mount(8); the agent is the only privileged silod component.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from contract.credentials import ANONYMOUS_ENV, CREDENTIAL_ENV
from contract.names import node_mount_job
from estimator.errors import UserError
from fuse_client.agent.datasets import DatasetResolver, DatasetSource, catalog_key

log = logging.getLogger("silod.agent")


def mount_job_id(node: str, key: str) -> str:
    """The data-manager job id of this node's mount of the dataset with storage key `key`: the
    scheduler's Kubernetes backend allocates remote IO to it (contract.names.node_mount_job, the
    one definition both planes use)."""
    return node_mount_job(node, key)


class MountError(Exception):
    """The node could not mount or bind (an operator's problem: FUSE, disk, permissions)."""


class AlreadyPublished(UserError):
    """The target path already holds this volume with another capability, or another volume
    (CSI: ALREADY_EXISTS)."""


@dataclass
class VolumeRecord:
    volume_id: str
    target: str
    tenant: str
    dataset: str
    uri: str
    cache_size: int | None
    namespace: str
    pod: str
    pod_uid: str = ""
    access_mode: int = 0  # the CSI access mode it was published with (a repeat must match)
    readonly: bool = True
    #: the dataset's storage key, its mount's name at the data manager ("" in records of agents
    #: before issue 20: looked up again, else catalog_key)
    key: str = ""


Key = tuple[str, str]  # (volume_id, target_path)


# The node's own cloud credentials, and the agent's own tokens: never a mount's.
AMBIENT_SECRETS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE",
                   "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN",
                   "SILOD_AGENT_TOKEN", "SILOD_SECRET_KEYS", *CREDENTIAL_ENV.values(), ANONYMOUS_ENV)


def _write_private(path: Path, data: bytes) -> None:
    """Write `path` readable by its owner only (0600, also when it existed with wider bits)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(data)


def mount_env(src: DatasetSource) -> dict[str, str]:
    """The environment of the `silod mount` of `src`: the dataset owner's credential, or
    anonymous s3 reads, never the node's ambient keys (any tenant could read any bucket the
    node can) nor the agent's tokens."""
    env = {k: v for k, v in os.environ.items() if k not in AMBIENT_SECRETS}
    if src.credential is not None:
        env.update(src.credential.to_env())
    else:
        env[ANONYMOUS_ENV] = "1"
    return env


MAX_LAYERS = 64  # binds stacked on one target by agent restarts that unpublish takes down


def _run(*args: str) -> None:
    r = subprocess.run(list(args), capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise MountError(f"{' '.join(args)}: {r.stderr.strip() or r.stdout.strip() or f'exit {r.returncode}'}")


def is_mountpoint(path: Path) -> bool:
    try:
        return os.path.ismount(path)
    except OSError:
        return False


def healthy(path: Path) -> bool:
    """A mount that answers (a dead FUSE daemon leaves ENOTCONN behind)."""
    try:
        os.listdir(path)
        return is_mountpoint(path)
    except OSError:
        return False


def unmount(path: Path) -> None:
    """Unmount; lazily when busy (a pod still has a file open), so the target can go away."""
    try:
        _run("umount", str(path))
    except MountError:
        _run("umount", "-l", str(path))


class VolumeManager:
    def __init__(self, state_dir: Path, node: str, *, silod: list[str], kubelet_dir: Path,
                 manager_url: str | None = None, mount_timeout: float = 30.0, idle_unmount_s: float = 60.0):
        self.state_dir = state_dir
        self.node = node
        self.silod = silod
        self.kubelet_dir = kubelet_dir.resolve()
        self.manager_url = manager_url
        self.mount_timeout = mount_timeout
        # A dataset mount outlives its last volume this long: a preempted job resumed by the next
        # Gavel round (or the next job on the dataset) reuses it instead of starting a new one.
        self.idle_unmount_s = idle_unmount_s
        self._idle: dict[tuple[str, str], threading.Timer] = {}
        self.lock = threading.RLock()
        # Starting a dataset's mount waits for it to list its source (network I/O: seconds for a
        # slow index). That wait holds only the dataset's own lock, never the node-wide `lock`,
        # so one tenant's slow source does not stall every other volume's set-up on the node.
        # Order: a dataset lock before `lock`, never the other way round.
        self._dataset_locks: dict[tuple[str, str], threading.Lock] = {}
        self.volumes: dict[Key, VolumeRecord] = {}
        self.procs: dict[tuple[str, str], subprocess.Popen] = {}
        self.keys: dict[tuple[str, str], str] = {}  # (tenant, dataset) -> storage key its mount runs under
        (state_dir / "mounts").mkdir(parents=True, exist_ok=True)
        (state_dir / "cache").mkdir(parents=True, exist_ok=True)
        os.chmod(state_dir / "cache", 0o700)  # cached data is read through mounts only
        # Every tenant's dataset mount is under mounts/: a user on the node must not read one
        # through it (issue 47: it was 0755); pods reach theirs through their bind mounts.
        os.chmod(state_dir / "mounts", 0o700)

    # --- state -----------------------------------------------------------------------------------

    @property
    def _state_file(self) -> Path:
        return self.state_dir / "volumes.json"

    def _save(self) -> None:
        tmp = self._state_file.with_suffix(".tmp")
        _write_private(tmp, json.dumps({"publications": [asdict(v) for _, v in sorted(self.volumes.items())]},
                                       indent=1).encode())
        os.replace(tmp, self._state_file)

    def recover(self, resolver: DatasetResolver | None = None) -> list[str]:
        """After a restart: re-create the dataset mounts of recorded volumes and repair their bind
        mounts. Returns the volume ids repaired; a volume whose target is gone is forgotten. The
        credential is never recorded: `resolver` looks it up again (without one, or when the
        look-up fails, the dataset is mounted anonymously)."""
        if not self._state_file.exists():
            return []
        try:
            doc = json.loads(self._state_file.read_text())
            # {"publications": [...]}; an agent before reference counting wrote {volume_id: record}.
            rows = doc["publications"] if "publications" in doc else list(doc.values())
            recorded = {(r.volume_id, r.target): r for r in (VolumeRecord(**v) for v in rows)}
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            log.error("ignoring unreadable %s: %s", self._state_file, exc)
            return []
        repaired = []
        with self.lock:
            for key, rec in recorded.items():
                vid = rec.volume_id
                target = Path(rec.target)
                if not target.exists():
                    continue
                self.volumes[key] = rec
                try:
                    src = self._dataset_mount(self._recorded_source(rec, resolver))
                    if not healthy(target):
                        # Stack the new bind on the dead one instead of unmounting it: a running
                        # pod's view of the target is a copy in its own mount namespace, a slave
                        # of this mount when its volumeMount has mountPropagation HostToContainer
                        # (the admission webhook sets it). A mount on top of this one propagates
                        # to that copy; an unmount followed by a new mount at the same path does
                        # not (the new mount's parent is kubelet's directory, not this mount), and
                        # the pod would keep reading ENOTCONN. unpublish unmounts every layer.
                        self._bind(src, target)
                    repaired.append(vid)
                except (MountError, UserError) as exc:
                    log.error("volume %s (%s/%s): could not restore after restart: %s", vid, rec.tenant, rec.dataset, exc)
            self._save()
        return repaired

    @staticmethod
    def _recorded_source(rec: VolumeRecord, resolver: DatasetResolver | None) -> DatasetSource:
        plain = DatasetSource(rec.tenant, rec.dataset, rec.uri, rec.cache_size,
                              key=rec.key or catalog_key(rec.tenant, rec.dataset))
        if resolver is None:
            return plain
        try:
            fresh = resolver.resolve(rec.tenant, rec.dataset)
        except UserError as exc:
            log.warning("%s/%s: credential not looked up again (%s); mounting it anonymously", rec.tenant, rec.dataset, exc)
            return plain
        # The key as the resolver says it now (a record of an older agent has none).
        return DatasetSource(rec.tenant, rec.dataset, rec.uri, rec.cache_size, key=fresh.key, credential=fresh.credential)

    # --- dataset mounts --------------------------------------------------------------------------

    def mount_path(self, tenant: str, dataset: str) -> Path:
        return self.state_dir / "mounts" / tenant / dataset

    def cache_dir(self, tenant: str) -> Path:
        return self.state_dir / "cache" / tenant

    def _dataset_mount(self, src: DatasetSource) -> Path:
        path = self.mount_path(src.tenant, src.name)
        key = (src.tenant, src.name)
        proc = self.procs.get(key)
        if proc is not None and proc.poll() is None and healthy(path):
            if self.keys.get(key, src.key) != src.key:
                # The dataset was deleted and registered again (a new id) while pods read it: the
                # live mount keeps its key until its last volume goes; the next mount takes the new.
                log.warning("%s/%s: mounted as %s, now registered as %s; the new key applies from the next mount",
                            src.tenant, src.name, self.keys[key], src.key)
            return path
        if is_mountpoint(path) or (path.exists() and not _listable(path)):
            unmount(path)  # a leftover of a dead mount process
        path.mkdir(parents=True, exist_ok=True)
        stats = self.stats_file(src.tenant, src.name)
        # The storage key, not the tenant's dataset name: the scheduler allocates cache to the key
        # and two tenants' `files` must be two data-manager entries and two caches (issue 20).
        cmd = [*self.silod, "mount", str(path), "--source", src.uri, "--dataset", src.key,
               "--job", mount_job_id(self.node, src.key), "--cache-dir", str(self.cache_dir(src.tenant)),
               "--stats-file", str(stats), "--allow-other", "--pod-stats",
               # Registered as this node (not the pod's host name): a node-bound data-manager token
               # accepts only its node's clients.
               "--node", self.node]
        if src.cache_size is not None:
            cmd += ["--cache-size", str(src.cache_size)]
        if self.manager_url:
            cmd += ["--manager", self.manager_url]
        log_path = self.state_dir / "mounts" / src.tenant / f"{src.name}.log"
        with os.fdopen(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as logf:
            os.fchmod(logf.fileno(), 0o600)  # tenants' dataset names and errors: the agent's only
            proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True, env=mount_env(src))
        self.procs[key] = proc
        self.keys[key] = src.key
        deadline = time.monotonic() + self.mount_timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = log_path.read_text(errors="replace")[-600:]
                raise MountError(f"silod mount of {src.tenant}/{src.name} exited with {proc.returncode}: {tail.strip()}")
            if is_mountpoint(path):
                return path
            time.sleep(0.05)
        proc.kill()
        raise MountError(f"silod mount of {src.tenant}/{src.name} did not come up in {self.mount_timeout:.0f}s")

    def _release(self, tenant: str, dataset: str) -> None:
        """Unmount a dataset no published volume uses any more, after `idle_unmount_s` (its cache
        stays on disk either way)."""
        if any(v.tenant == tenant and v.dataset == dataset for v in self.volumes.values()):
            return
        if self.idle_unmount_s > 0:
            old = self._idle.pop((tenant, dataset), None)
            if old is not None:
                old.cancel()
            timer = threading.Timer(self.idle_unmount_s, self._release_now, args=(tenant, dataset))
            timer.daemon = True
            self._idle[(tenant, dataset)] = timer
            timer.start()
            return
        self._release_now(tenant, dataset)

    def _release_now(self, tenant: str, dataset: str) -> None:
        dataset_lock = self._dataset_locks.setdefault((tenant, dataset), threading.Lock())
        if not dataset_lock.acquire(blocking=False):
            return  # a publish of the dataset is starting its mount: it is wanted again
        try:
            self._release_locked(tenant, dataset)
        finally:
            dataset_lock.release()

    def _release_locked(self, tenant: str, dataset: str) -> None:
        with self.lock:
            self._idle.pop((tenant, dataset), None)
            if any(v.tenant == tenant and v.dataset == dataset for v in self.volumes.values()):
                return  # published again meanwhile
            path = self.mount_path(tenant, dataset)
            proc = self.procs.pop((tenant, dataset), None)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # silod mount unmounts itself on SIGTERM
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
            if is_mountpoint(path):
                unmount(path)

    # --- bind mounts -------------------------------------------------------------------------------

    def _bind(self, source: Path, target: Path) -> None:
        target.mkdir(parents=True, exist_ok=True)
        _run("mount", "--bind", str(source), str(target))
        try:
            _run("mount", "-o", "remount,bind,ro,nosuid,nodev", str(target))
        except MountError:
            unmount(target)  # never leave a writable bind behind
            raise

    def check_target(self, target: str) -> Path:
        path = Path(target)
        if not path.is_absolute():
            raise UserError(f"target_path {target!r} is not absolute")
        resolved = path.parent.resolve() / path.name
        if self.kubelet_dir not in resolved.parents:
            raise UserError(f"target_path {target!r} is outside the kubelet directory {self.kubelet_dir}")
        return resolved

    def stats_file(self, tenant: str, dataset: str) -> Path:
        return self.state_dir / "mounts" / tenant / f"{dataset}.stats.json"

    def mount_stats_files(self) -> list[Path]:
        """The stats files of every dataset mount this agent has run (live or idle)."""
        return sorted((self.state_dir / "mounts").glob("*/*.stats.json"))

    def publish(self, volume_id: str, target: str, src: DatasetSource, namespace: str, pod: str,
                pod_uid: str = "", *, access_mode: int = 0, readonly: bool = True) -> None:
        """Bind the dataset's mount at `target`. Idempotent for the same (volume, target, capability);
        AlreadyPublished when the target holds this volume with another capability or dataset, or
        another volume."""
        path = self.check_target(target)
        with self.lock:
            have = self.volumes.get((volume_id, str(path)))
            if have is not None:
                if (have.tenant, have.dataset) != (src.tenant, src.name):
                    raise AlreadyPublished(f"volume {volume_id} is already published at {have.target} for "
                                           f"{have.tenant}/{have.dataset}")
                if (have.access_mode, have.readonly) != (access_mode, readonly):
                    raise AlreadyPublished(f"volume {volume_id} is already published at {have.target} with another"
                                           f" capability (access mode {have.access_mode}, readonly {have.readonly})")
                if healthy(path):
                    return  # idempotent repeat
            other = next((k for k in self.volumes if k[1] == str(path) and k[0] != volume_id), None)
            if other is not None:
                raise AlreadyPublished(f"target {path} already holds volume {other[0]}")
            dataset_lock = self._dataset_locks.setdefault((src.tenant, src.name), threading.Lock())
        with dataset_lock:
            source = self._dataset_mount(src)
            with self.lock:
                other = next((k for k in self.volumes if k[1] == str(path) and k[0] != volume_id), None)
                if other is not None:  # published meanwhile by another request
                    raise AlreadyPublished(f"target {path} already holds volume {other[0]}")
                self._bind_volume(volume_id, path, source, src, namespace, pod, pod_uid, access_mode, readonly)

    def _bind_volume(self, volume_id: str, path: Path, source: Path, src: DatasetSource, namespace: str, pod: str,
                     pod_uid: str, access_mode: int, readonly: bool) -> None:
        with self.lock:
            if is_mountpoint(path):
                unmount(path)
            self._bind(source, path)
            self.volumes[(volume_id, str(path))] = VolumeRecord(
                volume_id, str(path), src.tenant, src.name, src.uri, src.cache_size, namespace, pod, pod_uid,
                access_mode, readonly, self.keys.get((src.tenant, src.name), src.key))
            self._save()
            log.info("published %s/%s for pod %s/%s at %s", src.tenant, src.name, namespace, pod, path)

    def unpublish(self, volume_id: str, target: str) -> None:
        path = Path(target)
        with self.lock:
            resolved = path.parent.resolve() / path.name if path.is_absolute() else path
            rec = self.volumes.get((volume_id, str(resolved)))
            for _ in range(MAX_LAYERS):  # a bind per agent restart may be stacked here (recover)
                if not (is_mountpoint(path) or (path.exists() and not _listable(path))):
                    break
                unmount(path)
            try:
                path.rmdir()  # CSI: the SP removes the target it created
            except OSError:
                pass
            if rec is None:
                return  # idempotent: unknown or already unpublished
            del self.volumes[(volume_id, str(resolved))]
            self._save()
            self._release(rec.tenant, rec.dataset)
            log.info("unpublished %s (%s/%s) from %s", volume_id, rec.tenant, rec.dataset, path)

    def close(self, unmount_all: bool = False) -> None:
        """Stop serving. Without `unmount_all` the records stay, for the next agent to restore."""
        with self.lock:
            for timer in self._idle.values():
                timer.cancel()
            self._idle.clear()
            if unmount_all:
                for (vid, _), rec in list(self.volumes.items()):
                    self.unpublish(vid, rec.target)
            for (tenant, dataset), proc in list(self.procs.items()):
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                    try:
                        proc.wait(15)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                path = self.mount_path(tenant, dataset)
                if is_mountpoint(path):
                    try:
                        unmount(path)
                    except MountError as exc:
                        log.warning("%s", exc)
            self.procs.clear()


def _listable(path: Path) -> bool:
    try:
        os.listdir(path)
        return True
    except OSError:
        return False
