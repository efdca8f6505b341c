"""`silod top`: the web view's picture (GET /v1/overview) in a terminal of 80 columns,
refreshing. `render` is a pure function of the overview (tests call it); the command only
fetches and redraws."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from estimator.units import format_rate, format_size

WIDTH = 80
SPARK = " ▁▂▃▄▅▆▇█"
BOUND_WORDS = {"gpu": "GPU", "cpu": "CPU", "cache": "cache", "remote_io": "IO"}  # what limits a running job, short


def _size(v: float | None) -> str:
    return "-" if v is None else format_size(v)


def _rate(v: float | None) -> str:
    return "-" if v is None else format_rate(v)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def sparkline(values: list[float], width: int) -> str:
    """The last `width` values (each 0..1) as block characters."""
    tail = values[-width:]
    return "".join(SPARK[min(int(round(max(v, 0.0) * (len(SPARK) - 1))), len(SPARK) - 1)] for v in tail)


def render(o: Mapping[str, Any]) -> Group:
    """The overview as a header, a utilisation line, the running jobs, the queue and datasets;
    every table fits 80 columns (long names are cut, not wrapped)."""
    head = Text(f"silod · policy {o['policy']} · {o['running_total']} running, {o['queued_total']} waiting · "
                f"{time.strftime('%H:%M:%S', time.localtime(o['time']))}", style="bold")
    usage = Text(f"GPUs {o['gpus_used']} of {o['gpus_total']} · cache {_size(o['cache_allocated'])} of "
                 f"{_size(o['cache_total'])} · remote IO allocated {_rate(o['remote_io_allocated'])} of {_rate(o['remote_io_total'])}")
    # What the running jobs read, measured (the data plane's figures), beside what was allocated:
    # an allocation is a cap, not traffic.
    measured = [j["throughput"] for j in o["running"] if j.get("throughput") is not None]
    usage.append(f" · measured read {_rate(sum(measured))}" if measured else " · measured read -")
    history = list(o.get("history") or [])
    spark = sparkline([h["gpus_used"] / max(o["gpus_total"], 1) for h in history], WIDTH - 12)
    chart = Text(f"GPUs used  {spark}" if spark else "GPUs used  (no samples yet)")

    running = Table(title="running", title_justify="left", expand=False, pad_edge=False, box=None)
    for col, just in (("id", "right"), ("name", "left"), ("gpu", "right"), ("cache", "right"), ("IO alloc", "right"),
                      ("hit", "right"), ("read", "right"), ("f*", "right"), ("done", "right"), ("bound", "left")):
        running.add_column(col, justify=just, no_wrap=True, overflow="ellipsis", max_width=10 if col == "name" else None)
    for j in o["running"]:
        running.add_row(j["id"], j["name"], str(j["gpus"]), _size(j["cache_bytes"]), _rate(j["remote_io"]),
                        _pct(j["hit_ratio"]), _rate(j["throughput"]), _rate(j["ideal_throughput"]),
                        _pct(j["progress"]), BOUND_WORDS.get(j["bound"], j["bound"]))
    queue = Table(title="queue", title_justify="left", expand=False, pad_edge=False, box=None)
    for col, just in (("#", "right"), ("id", "right"), ("name", "left"), ("gpu", "right"), ("why it waits", "left")):
        # the reason wraps rather than being cut: it is the point of the table
        queue.add_column(col, justify=just, no_wrap=col != "why it waits", overflow="ellipsis" if col == "name" else "fold",
                         max_width={"name": 10}.get(col))
    for q in o["queue"]:
        queue.add_row(str(q["position"]), q["id"], q["name"], str(q["gpus"]), q["reason"])
    datasets = Table(title="datasets", title_justify="left", expand=False, pad_edge=False, box=None)
    for col, just in (("name", "left"), ("tenant", "left"), ("size", "right"), ("allocated", "right"),
                      ("cached", "right")):
        datasets.add_column(col, justify=just, no_wrap=True, overflow="ellipsis", max_width=20)
    for d in o["datasets"]:
        datasets.add_row(d["name"], d["owner"], _size(d["size"]), _size(d["allocated"]), _size(d["cached"]))
    parts: list[Any] = [head, usage, chart]
    if o.get("scheduling"):  # e.g. "scheduler starting: compiling policy kernels, 12 s"
        parts.append(Text(o["scheduling"], style="bold yellow"))
    parts.append(Text(""))
    parts.append(running if o["running"] else Text("running: none"))
    parts.append(Text(""))
    parts.append(queue if o["queue"] else Text("queue: empty"))
    parts.append(Text(""))
    parts.append(datasets if o["datasets"] else Text("datasets: none"))
    return Group(*parts)


def run_top(fetch: Callable[[], Mapping[str, Any]], once: bool, interval: float) -> None:
    from rich.console import Console
    from rich.live import Live

    console = Console(width=WIDTH) if once or not Console().is_terminal else Console()
    if once:
        console.print(render(fetch()))
        return
    with Live(render(fetch()), console=console, refresh_per_second=4, screen=False) as live:
        while True:
            time.sleep(interval)
            live.update(render(fetch()))
