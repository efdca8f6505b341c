"""The public traces silod reads, and where a user gets each one.

Gavel's msr traces (MIT) ship with silod in traces/gavel-msr, with their licence. Alibaba's
openb trace does not: alibaba/clusterdata carries no licence for cluster-trace-gpu-v2023 (the
repository's only LICENSE file, CC BY 4.0, is in cluster-trace-gpu-v2020/), so without the
owner's grant it may be read but not redistributed; `silod trace fetch alibaba-openb` downloads
it from its repository at a pinned commit and checks every file's SHA-256 (traces/fetch.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

#: The Gavel/Philly traces shipped with silod (tab-separated *.trace files, Gavel's
#: simulation_throughputs.json, LICENSE and README.md).
SHIPPED_GAVEL_DIR = Path(__file__).resolve().parent / "gavel-msr"


@dataclass(frozen=True, slots=True)
class PinnedFile:
    name: str
    size: int  # bytes; also the cap on what a download may send
    sha256: str


@dataclass(frozen=True, slots=True)
class PublicTrace:
    name: str
    repository: str  # https://github.com/OWNER/NAME
    commit: str  # the full commit the files are pinned at
    folder: str  # inside the repository
    files: tuple[PinnedFile, ...]
    why_fetched: str  # why silod does not ship it

    def url(self, file: PinnedFile, base_url: str | None = None) -> str:
        """Where `file` is downloaded from: GitHub's raw file service at the pinned commit, or
        `base_url`/<file> (a mirror holding the same files)."""
        if base_url is not None:
            return f"{base_url.rstrip('/')}/{file.name}"
        owner_name = self.repository.removeprefix("https://github.com/")
        return f"https://raw.githubusercontent.com/{owner_name}/{self.commit}/{self.folder}/{file.name}"


ALIBABA_OPENB = PublicTrace(
    name="alibaba-openb",
    repository="https://github.com/alibaba/clusterdata",
    commit="7358bbaf40778d4bd0464a64a430812088b7b74e",
    folder="cluster-trace-gpu-v2023/csv",
    files=(
        PinnedFile("openb_pod_list_default.csv", 575468, "1ee7ed79c27a3b0861cda8ddba86a004c6aba904caafa329a76ae93ca63834a8"),
        PinnedFile("openb_node_list_gpu_node.csv", 42353, "2beca64b4d3dfa342036a34b56a495c6cef9225db836c81f541282cb1df320b5"),
    ),
    why_fetched="alibaba/clusterdata publishes no licence for cluster-trace-gpu-v2023, so silod may not redistribute it",
)

FETCHABLE: dict[str, PublicTrace] = {ALIBABA_OPENB.name: ALIBABA_OPENB}


def default_fetch_dir(name: str) -> Path:
    """Where `silod trace fetch NAME` puts a trace and where `silod experiment alibaba` looks
    for it: $SILOD_TRACES_DIR/NAME, else $XDG_CACHE_HOME/silod/traces/NAME (~/.cache/...)."""
    root = os.environ.get("SILOD_TRACES_DIR")
    if root:
        return Path(root) / name
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "silod" / "traces" / name


def where_to_get() -> str:
    """The sentence an error about a missing trace ends with: where each public trace is."""
    return (f"Gavel's msr traces ship with silod in {SHIPPED_GAVEL_DIR}; Alibaba's openb trace is downloaded by "
            f"`silod trace fetch alibaba-openb` (into {default_fetch_dir(ALIBABA_OPENB.name)}); "
            "a CSV trace's columns are in docs/simulator.md")


__all__ = ["ALIBABA_OPENB", "FETCHABLE", "SHIPPED_GAVEL_DIR", "PinnedFile", "PublicTrace", "default_fetch_dir", "where_to_get"]
