"""`silod agent`: the node agent (DaemonSet on GPU nodes), and `silod csi-controller`: the CSI
Controller service (dynamic provisioning of silod PVCs); registered by scheduler/cli.py."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from estimator.errors import UserError
from contract.log_level import parse_log_level


def register(app: typer.Typer) -> None:
    register_controller(app)

    @app.command()
    def agent(
        socket: Annotated[Path, typer.Option("--socket", help="CSI unix socket kubelet connects to")] =
            Path("/var/lib/kubelet/plugins/silod.io/csi.sock"),
        state_dir: Annotated[Path, typer.Option("--state-dir", help="node-local mounts, cache and volume records")] =
            Path("/var/lib/silod"),
        node: Annotated[str | None, typer.Option("--node", help="node name [default: $NODE_NAME]")] = None,
        datasets: Annotated[Path | None, typer.Option("--datasets", help="YAML catalog: datasets: [{tenant, name, uri}]")] = None,
        scheduler: Annotated[str | None, typer.Option("--scheduler", help="silod scheduler URL to look datasets up"
                                                      " (token from $SILOD_AGENT_TOKEN)")] = None,
        manager: Annotated[str | None, typer.Option("--manager", help="data manager URL (cache/IO allocations)")] = None,
        kubelet_dir: Annotated[Path, typer.Option("--kubelet-dir", help="target paths must be under it")] =
            Path("/var/lib/kubelet"),
        namespace_prefix: Annotated[str, typer.Option("--namespace-prefix", help="tenant T's namespace is PREFIX+T")] = "",
        idle_unmount: Annotated[float, typer.Option("--idle-unmount", help="seconds a dataset mount outlives its last"
                                                    " pod (a resumed job reuses it)")] = 60.0,
        report_interval: Annotated[float, typer.Option("--report-interval", help="seconds between consumption reports"
                                                       " to --scheduler (0: do not report)")] = 10.0,
        report_token_file: Annotated[Path | None, typer.Option("--report-token-file", help="this node's agent token"
                                                               " (bound to the node: silod serve --node-agent USER=NODE),"
                                                               " re-read at every report [default: $SILOD_AGENT_TOKEN]")] = None,
        cache_size: Annotated[str | None, typer.Option("--cache-size", help="the most this node's cache may use"
                                                       " (e.g. 500GB); the agent reports the smaller of it and its"
                                                       " cache directory's disk [default: the whole disk]")] = None,
        log_level: Annotated[str, typer.Option("--log-level")] = "info",
    ) -> None:
        """Serve the CSI Identity and Node services for the silod.io driver on this node."""
        import logging
        import signal
        import sys
        import threading

        from fuse_client.agent.server import Agent
        from fuse_client.agent.volumes import VolumeManager

        logging.basicConfig(level=parse_log_level(log_level).upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        node = node or os.environ.get("NODE_NAME")
        if not node:
            raise UserError("no node name: pass --node or set NODE_NAME (the DaemonSet sets it from spec.nodeName)")
        cap = None  # checked before the dataset source, so a bad flag is named first
        if cache_size is not None:
            from estimator.units import UnitError, parse_size

            try:
                cap = int(parse_size(cache_size, "--cache-size"))
            except UnitError as exc:
                raise UserError(str(exc)) from None
            if cap < 1:
                raise UserError(f"--cache-size {cache_size!r} must be positive (e.g. 500GB)")
        resolver = _dataset_resolver(datasets, scheduler)
        silod = [str(Path(sys.executable).parent / "silod")]
        if not Path(silod[0]).exists():
            silod = [sys.executable, "-c", "from scheduler.cli import main; main()"]
        volumes = VolumeManager(state_dir, node, silod=silod, kubelet_dir=kubelet_dir, manager_url=manager,
                                idle_unmount_s=idle_unmount)
        server = Agent(socket, node, volumes, resolver, namespace_prefix=namespace_prefix)
        if report_interval < 0 or report_interval > 3600:
            raise UserError(f"--report-interval {report_interval} must be between 0 and 3600 seconds")
        reporter = None
        if report_interval > 0 and scheduler is not None:
            from fuse_client.agent.reporter import ConsumptionReporter, cache_disk_bytes, token_source

            if report_token_file is not None and not report_token_file.is_file():
                raise UserError(f"--report-token-file {str(report_token_file)!r} does not exist")
            reporter = ConsumptionReporter(
                node=node, mounts=volumes.mount_stats_files, state_file=state_dir / "consumption.json", url=scheduler,
                token=token_source(report_token_file, os.environ.get("SILOD_AGENT_TOKEN")), interval_s=report_interval,
                cache_disk=lambda: cache_disk_bytes(state_dir / "cache", cap))
        repaired = server.start()
        if reporter is not None:
            reporter.start()
        typer.echo(f"silod agent on {node}: CSI driver silod.io at unix://{socket}; restored {len(repaired)} volume(s)",
                   err=True)
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
        # Published volumes stay recorded: the next agent on this node restores them.
        if reporter is not None:
            reporter.stop()
        server.stop(unmount_all=False)


def register_controller(app: typer.Typer) -> None:
    @app.command("csi-controller")
    def csi_controller(
        socket: Annotated[Path, typer.Option("--socket", help="CSI unix socket the csi-provisioner sidecar connects to")] =
            Path("/csi/csi.sock"),
        datasets: Annotated[Path | None, typer.Option("--datasets", help="YAML catalog: datasets: [{tenant, name, uri}]")] = None,
        scheduler: Annotated[str | None, typer.Option("--scheduler", help="silod scheduler URL to look datasets up"
                                                      " (token from $SILOD_AGENT_TOKEN)")] = None,
        namespace_prefix: Annotated[str, typer.Option("--namespace-prefix", help="tenant T's namespace is PREFIX+T")] = "",
        log_level: Annotated[str, typer.Option("--log-level")] = "info",
    ) -> None:
        """Serve the CSI Identity and Controller services (dynamic provisioning of silod PVCs)."""
        import logging
        import signal
        import threading

        from fuse_client.agent.server import ControllerServer

        logging.basicConfig(level=parse_log_level(log_level).upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        resolver = _dataset_resolver(datasets, scheduler)
        server = ControllerServer(socket, resolver, namespace_prefix)
        server.start()
        typer.echo(f"silod csi-controller: CSI driver silod.io (Identity, Controller) at unix://{socket}", err=True)
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
        server.stop()


def _dataset_resolver(datasets, scheduler):  # type: ignore[no-untyped-def]
    """Dataset names resolved from a catalog file, or from the scheduler with the agent's token."""
    from fuse_client.agent.datasets import CatalogResolver, SchedulerResolver

    from contract.placeholders import refuse_placeholders

    refuse_placeholders()
    if (datasets is None) == (scheduler is None):
        raise UserError("give exactly one of --datasets FILE or --scheduler URL to resolve dataset names")
    if scheduler is None:
        return CatalogResolver(datasets)
    token_file = os.environ.get("SILOD_AGENT_TOKEN_FILE")
    if token_file:
        # An agent pod's projected service-account token: kubelet rotates it, so read it per call.
        if not Path(token_file).is_file():
            raise UserError(f"SILOD_AGENT_TOKEN_FILE={token_file} does not exist")
        return SchedulerResolver(scheduler, lambda: Path(token_file).read_text().strip())
    token = os.environ.get("SILOD_AGENT_TOKEN")
    if not token:
        raise UserError("--scheduler needs the agent's token (dataset look-ups) in $SILOD_AGENT_TOKEN or a file"
                        " named by $SILOD_AGENT_TOKEN_FILE")
    return SchedulerResolver(scheduler, token)
