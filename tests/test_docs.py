"""README.md and docs/*.md run as written.

Every fenced block of commands (no language, bash, sh, shell, console) carries a marker comment
on the line before it:

    <!-- doc-test: run [background] [needs=fuse,s3] [ports=7070,...] [ready=URL] [expect="text"] -->
    <!-- doc-test: file=NAME -->          the block is a file the next blocks use (e.g. a trace; NAME
                                          may be a relative path, its directories are created)
    <!-- doc-test: skip REASON -->        cannot run here (a Kubernetes cluster, the test suite itself)

Blocks of one document run in order, in one fresh temporary directory (relative paths in the
examples land there), with bash -euo pipefail, `silod` from this installation on PATH and
XDG_STATE_HOME inside the temporary directory. A `run` block must exit 0 and print `expect`.
A `background` block is a server: it starts, the test waits for `ready` to answer 200, and it is
stopped when the document is done. Two substitutions are made, both mechanical and visible
here: each port listed in `ports=` (written `:PORT` or `-p PORT`) is replaced by a free port (the same one for the whole
document), so the examples can keep the ports people use; and `needs=s3` starts a real
S3-compatible server (moto in server mode, as the data-plane tests do) on the port the example
names, holding `s3://datasets/imagenet/train/item-{0..9}.jpg`.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND_LANGUAGES = {"", "bash", "sh", "shell", "console"}
MARKER_RE = re.compile(r"^<!--\s*doc-test:\s*(.*?)\s*-->\s*$")
FENCE_RE = re.compile(r"^```(\S*)")
BLOCK_TIMEOUT_S = 180


@dataclass
class Block:
    document: Path
    line: int
    language: str
    text: str
    marker: str | None  # the directive text, None if the block has no marker
    options: dict[str, str] = field(default_factory=dict)

    @property
    def action(self) -> str | None:
        return None if self.marker is None else self.marker.split()[0].split("=")[0]

    @property
    def where(self) -> str:
        return f"{self.document.relative_to(ROOT)}:{self.line}"


def parse_blocks(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        fence = FENCE_RE.match(lines[i])
        if not fence:
            i += 1
            continue
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        prev = start - 1
        while prev >= 0 and not lines[prev].strip():
            prev -= 1
        marker = MARKER_RE.match(lines[prev]) if prev >= 0 else None
        directive = marker.group(1) if marker else None
        options: dict[str, str] = {}
        if directive and not directive.startswith("skip"):
            for token in shlex.split(directive):
                key, _, value = token.partition("=")
                options[key] = value
        blocks.append(Block(path, start + 1, fence.group(1).lower(), "\n".join(body) + "\n", directive, options))
        i += 1
    return blocks


def test_every_command_block_is_marked():
    unmarked = [b.where for doc in DOCUMENTS for b in parse_blocks(doc)
                if b.language in COMMAND_LANGUAGES and b.marker is None]
    assert not unmarked, ("command blocks without a `<!-- doc-test: run|file=|skip REASON -->` marker "
                          f"(see tests/test_docs.py): {unmarked}")
    skips_without_reason = [b.where for doc in DOCUMENTS for b in parse_blocks(doc)
                            if b.marker is not None and b.marker.split() == ["skip"]]
    assert not skips_without_reason, f"skip markers must say why: {skips_without_reason}"


def test_quick_start_is_the_first_section():
    from_readme = quick_start_commands()
    assert len(from_readme) == 2 and from_readme[1] == "bash .ci/run"
    assert "silod simulate" in from_readme[0]


def quick_start_commands() -> list[str]:
    """The README's quick-start commands, as .ci/run extracts them (the first fenced block)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Quick start", 1)[1]
    block = section.split("```", 2)[1]
    return [line for line in block.splitlines()[1:] if line.strip()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _needs_fuse() -> None:
    from scheduler.backends.local import fuse_problems

    problems = fuse_problems()
    if problems:
        message = "real FUSE mounts unavailable: " + "; ".join(problems)
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)


class S3Server:
    """moto's S3-compatible server on `port`, with the bucket the README's S3 example reads."""

    def __init__(self, port: int) -> None:
        import boto3
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        self.server.start()
        s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", aws_access_key_id="testing",
                          aws_secret_access_key="testing", region_name="us-east-1")
        s3.create_bucket(Bucket="datasets")
        for i in range(10):
            s3.put_object(Bucket="datasets", Key=f"imagenet/train/item-{i}.jpg", Body=os.urandom(50_000))

    def stop(self) -> None:
        self.server.stop()


class DocumentRun:
    """Runs a document's blocks in order in one directory; stops its servers and mounts after."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.ports: dict[str, str] = {}
        self.background: list[tuple[Block, subprocess.Popen, Path]] = []
        self.s3: S3Server | None = None
        bin_dir = str(Path(sys.executable).parent)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("SILOD_", "AWS_"))}
        self.env.update(PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""), XDG_STATE_HOME=str(workdir / "xdg-state"),
                        COLUMNS="100")

    def substitute(self, text: str, block: Block) -> str:
        for port in filter(None, block.options.get("ports", "").split(",")):
            new = self.ports.setdefault(port, str(_free_port()))
            text = re.sub(rf"(?:(?<=:)|(?<=-p )){port}\b", new, text)  # HOST:PORT, or `-p PORT`
        return text

    def run(self, block: Block) -> None:
        if "file" in block.options:
            target = self.workdir / block.options["file"]  # e.g. a plug-in's my-plugin/pyproject.toml
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(block.text, encoding="utf-8")
            return
        if block.action == "skip":
            return
        assert block.action == "run", f"{block.where}: unknown doc-test directive {block.marker!r}"
        needs = set(filter(None, block.options.get("needs", "").split(",")))
        if "fuse" in needs:
            _needs_fuse()
        script = self.substitute(block.text, block)
        if "s3" in needs and self.s3 is None:
            s3_port = next((self.ports[p] for p in block.options.get("ports", "").split(",") if p in self.ports), None)
            assert s3_port, f"{block.where}: needs=s3 names the S3 server's port in ports="
            self.s3 = S3Server(int(s3_port))
        if "background" in block.options:
            self._start_background(block, script)
            return
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=self.workdir, env=self.env,
                              capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S, stdin=subprocess.DEVNULL)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{block.where} exited {proc.returncode}:\n{script}\n--- output:\n{output[-4000:]}"
        assert "Traceback" not in output, f"{block.where}:\n{output[-4000:]}"
        expect = block.options.get("expect")
        if expect:
            assert expect in output, f"{block.where}: expected {expect!r} in the output:\n{output[-4000:]}"

    def _start_background(self, block: Block, script: str) -> None:
        log = self.workdir / f"background-{block.line}.log"
        with log.open("wb") as handle:
            proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", script], cwd=self.workdir, env=self.env,
                                    stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        self.background.append((block, proc, log))
        ready = block.options.get("ready")
        if not ready:
            return
        url = self.substitute(ready, block)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"{block.where} exited {proc.returncode} before {url} answered:\n{log.read_text()[-4000:]}")
            try:
                if httpx.get(url, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"{block.where}: {url} did not answer within 60 s:\n{log.read_text()[-4000:]}")

    def close(self) -> None:
        for _, proc, _ in self.background:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for _, proc, _ in self.background:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        self._stop_detached()
        with open("/proc/mounts") as mounts:  # an example that failed half-way may leave a mount
            leftover = [line.split()[1] for line in mounts if str(self.workdir) in line]
        for mountpoint in leftover:
            subprocess.run(["fusermount3", "-u", "-z", mountpoint], capture_output=True)
        if self.s3 is not None:
            self.s3.stop()


    def _stop_detached(self) -> None:
        """The local backend's job workers (and their mounts) run in sessions of their own so that
        jobs survive a service restart: stopping an example's `silod serve` leaves them running.
        Stop every process group whose command line names a path in this document's directory."""
        groups = set()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                if any(str(self.workdir).encode() in arg for arg in argv):
                    groups.add(os.getpgid(int(entry.name)))
            except (OSError, ProcessLookupError):
                continue  # ended meanwhile
        groups.discard(os.getpgrp())
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for group in groups:
                try:
                    os.killpg(group, sig)
                except ProcessLookupError:
                    pass
            if sig == signal.SIGTERM and groups:
                time.sleep(2)  # a worker unmounts its dataset on SIGTERM


def _examples(document: Path) -> list[Block]:
    return [b for b in parse_blocks(document) if b.marker is not None and b.action != "skip"]


# Documents whose every command block is marked skip (with its reason) have nothing to run.
RUNNABLE = [d for d in DOCUMENTS if _examples(d)]


def test_readme_has_runnable_examples():
    assert ROOT / "README.md" in RUNNABLE


@pytest.mark.parametrize("document", RUNNABLE, ids=[str(d.relative_to(ROOT)) for d in RUNNABLE])
def test_document_examples_run_as_written(document, tmp_path):
    blocks = _examples(document)
    run = DocumentRun(tmp_path)
    try:
        for block in blocks:
            run.run(block)
    finally:
        run.close()


# --- links -------------------------------------------------------------------------------------

LINK_RE = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
IMAGE_RE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")
HEADING_RE = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: markup dropped, lower case, punctuation but `-` and `_`
    removed, spaces to hyphens (no collapsing: "a — b" gives "a--b")."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading keeps its text
    text = re.sub(r"<[^>]+>", "", text).replace("\\", "")
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors_of(path: Path) -> set[str]:
    """Every anchor a Markdown file defines: its headings (GitHub's -1, -2 suffixes for repeats)
    and explicit `<a id=...>` / `<a name=...>` tags. Headings inside fenced blocks do not count."""
    seen: dict[str, int] = {}
    anchors: set[str] = set()
    in_fence = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        anchors.update(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", line))
        heading = HEADING_RE.match(line)
        if heading:
            slug = github_anchor(heading.group(2))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def relative_links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every link and image in a Markdown file that is not a URL with a scheme
    or a mail address; links inside fenced blocks and inline code are not links."""
    found: list[tuple[int, str]] = []
    in_fence = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("```"):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        line = re.sub(r"`[^`]*`", "", line)
        for target in [*LINK_RE.findall(line), *IMAGE_RE.findall(line)]:
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
                continue  # https:, mailto:, ...
            found.append((number, target))
    return found


def broken_links(documents: list[Path]) -> list[str]:
    broken = []
    for document in documents:
        for line, target in relative_links(document):
            where = f"{document.relative_to(ROOT)}:{line}: {target}"
            file_part, _, anchor = target.partition("#")
            linked = (document.parent / file_part).resolve() if file_part else document
            if not linked.exists():
                broken.append(f"{where} (no file {file_part})")
                continue
            if anchor and linked.suffix == ".md" and anchor not in anchors_of(linked):
                broken.append(f"{where} (no heading or anchor #{anchor} in {linked.relative_to(ROOT)})")
    return broken


def test_relative_links_and_anchors_resolve():
    broken = broken_links(DOCUMENTS)
    assert not broken, "broken links in README.md / docs/:\n" + "\n".join(broken)


def test_link_check_catches_a_missing_file_and_a_missing_anchor(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "b.md").write_text("# Speed and `memory` (targets)\n\n## Usage\n\n## Usage\n", encoding="utf-8")
    doc = tmp_path / "a.md"
    doc.write_text("[ok](b.md#speed-and-memory-targets) [ok2](b.md#usage-1) [self](#top)\n"
                   "# Top\n[gone](c.md) [bad](b.md#speed) `[code](nowhere.md)` [web](https://x.invalid/y)\n"
                   "```\n[fenced](nowhere.md)\n```\n", encoding="utf-8")
    assert broken_links([doc]) == [
        "a.md:3: c.md (no file c.md)",
        "a.md:3: b.md#speed (no heading or anchor #speed in b.md)",
    ]


def test_no_page_is_a_diary():
    """docs/ say what the product does and measured; when and by whom is git log and CHANGELOG."""
    diary = re.compile(r"\b(?:(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|helper|this|"
                       r"the) session\b|session \d|[Rr]egenerated (?:on|again)|20\d\d-\d\d-\d\d)")
    hits = [f"{d.relative_to(ROOT)}:{n}: {line.strip()[:80]}" for d in DOCUMENTS
            for n, line in enumerate(d.read_text(encoding="utf-8").splitlines(), 1) if diary.search(line)]
    assert not hits, "dates and sessions belong in CHANGELOG.md:\n" + "\n".join(hits)


def test_no_page_is_too_long():
    long_pages = {str(d.relative_to(ROOT)): n for d in DOCUMENTS
                  if (n := len(d.read_text(encoding="utf-8").splitlines())) > 420}
    assert not long_pages, f"split these pages by topic (at most ~400 lines): {long_pages}"
