"""Read the fenced blocks of README.md and docs/*.md, classify them by their directives, run them.

The convention is documented at the top of tests/test_docs_snippets.py; this module implements it:
`read_page` parses a page into `Block`s (with the problems that make a block unclassifiable),
`PageRun` runs one page's blocks in order in one working directory, `output_mismatch` compares a
shown output with the real one.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNNABLE = ("python", "bash")
BLOCK_TIMEOUT = float(os.environ.get("FREETOKEN_DOCS_TIMEOUT", "120"))
"""Seconds one block may run (FREETOKEN_DOCS_TIMEOUT overrides)."""
SERVER_START_TIMEOUT = 120.0
SERVER_ADDRESSES = ("127.0.0.1:8000", "localhost:8000")
"""Spellings of the default `freetoken serve` address that a with-server block's text may use."""

_FENCE_OPEN = re.compile(r"^( {0,3})(`{3,}|~{3,})\s*([^\s`]*)[^`]*$")
_DIRECTIVE = re.compile(r"^\s*<!--\s*snippet:\s*(.*?)\s*-->\s*$")
_LOOSE_DIRECTIVE = re.compile(r"<!--\s*snippet\b")
_DIRECTIVE_BODY = re.compile(r"^(output|file|text|skip|expect|with-server)(?![\w-])(.*)$", re.DOTALL)


def pages() -> list[str]:
    """Every page whose blocks are run: README.md, then docs/*.md, as paths relative to the repo."""
    return ["README.md"] + sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))


@dataclass
class Block:
    """One fenced block of a page and what its directives make of it.

    kind: "python" / "bash" (run), "skip" (runnable, not run), "output" (compared with the output
    of the closest runnable block above), "file" (written to `file_name`), "text" (neither run nor
    compared), "invalid" (see `problems`).
    """

    page: str
    line: int  # 1-based line of the opening fence
    info: str  # the fence's language ("" for none)
    text: str
    kind: str = "invalid"
    reason: str = ""  # skip / text reason
    file_name: str = ""
    expects: list[str] = field(default_factory=list)
    server_flags: str | None = None  # None: no server; "" or "--flags": start `freetoken serve`
    problems: list[str] = field(default_factory=list)
    shows: int | None = None  # for an output block: index of the runnable block it shows

    @property
    def id(self) -> str:
        return f"{self.page}:L{self.line}"


@dataclass
class Page:
    path: str
    blocks: list[Block]
    problems: list[str]  # page-level: directives that precede no block, unclosed fences


def read_page(page: str) -> Page:
    """Parse `page` (relative to the repo root) into its blocks, classified."""
    lines = (ROOT / page).read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    problems: list[str] = []
    pending: list[tuple[int, str]] = []  # (line, directive body) not yet attached to a block
    i = 0
    while i < len(lines):
        line = lines[i]
        opened = _FENCE_OPEN.match(line)
        if opened:
            indent, fence, info = opened.groups()
            close = re.compile(rf"^ {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}\s*$")
            body: list[str] = []
            j = i + 1
            while j < len(lines) and not close.match(lines[j]):
                body.append(_dedent(lines[j], len(indent)))
                j += 1
            if j == len(lines):
                problems.append(f"{page}:L{i + 1}: the fence is never closed")
            block = Block(page, i + 1, info.lower(), "\n".join(body) + "\n")
            _classify(block, pending)
            blocks.append(block)
            pending = []
            i = j + 1
            continue
        directive = _DIRECTIVE.match(line)
        if directive:
            pending.append((i + 1, directive.group(1)))
        elif _LOOSE_DIRECTIVE.search(line):
            problems.append(
                f"{page}:L{i + 1}: a snippet directive must be alone on its line: {line.strip()!r}"
            )
        elif line.strip() and pending:
            problems.append(
                f"{page}:L{pending[0][0]}: snippet directive(s) not directly followed by a fenced block "
                f"(only blank lines and other directives may come between)"
            )
            pending = []
        i += 1
    if pending:
        problems.append(f"{page}:L{pending[0][0]}: snippet directive(s) after the last block")
    last_runnable: int | None = None
    for index, block in enumerate(blocks):
        if block.kind in ("python", "bash", "skip"):
            last_runnable = index
        elif block.kind == "output":
            if last_runnable is None:
                block.problems.append("an output block with no runnable block above it")
                block.kind = "invalid"
            else:
                block.shows = last_runnable
    return Page(page, blocks, problems)


def _dedent(line: str, width: int) -> str:
    return line[width:] if line[:width].strip() == "" else line.lstrip()


def _classify(block: Block, directives: list[tuple[int, str]]) -> None:
    roles: list[str] = []
    for line, body in directives:
        parsed = _DIRECTIVE_BODY.match(body)
        name, rest = (parsed.group(1), parsed.group(2).strip()) if parsed else ("", "")
        if name == "output" and not rest:
            roles.append("output")
        elif name == "file" and rest and len(rest.split()) == 1:
            roles.append("file")
            block.file_name = rest
        elif name in ("text", "skip") and (not rest or rest.startswith(":")):
            block.reason = rest[1:].strip()
            if not block.reason:
                block.problems.append(f"L{line}: `{name}` needs a reason: <!-- snippet: {name}: REASON -->")
            roles.append(name)
        elif name == "expect" and rest:
            try:
                re.compile(rest, re.MULTILINE)
            except re.error as e:
                block.problems.append(f"L{line}: bad expect regex {rest!r}: {e}")
            block.expects.append(rest)
        elif name == "with-server" and (not rest or rest.startswith(":")):
            block.server_flags = rest[1:].strip()
        else:
            block.problems.append(f"L{line}: unknown snippet directive {body!r}")
    runnable = block.info in RUNNABLE
    if len(roles) > 1:
        block.problems.append(f"more than one of output / file / text / skip: {roles}")
    role = roles[0] if roles else None
    if role == "file":
        block.kind = "file"
    elif runnable:
        if role in ("output", "text"):
            block.problems.append(
                f"a `{block.info}` block is run; `{role}` is for other fences "
                "(use `skip: REASON` not to run it)"
            )
        block.kind = "skip" if role == "skip" else block.info
    else:
        if role is None:
            block.problems.append(
                f"a fence with info {block.info or '(none)'!r} is never run and needs a directive before it: "
                "<!-- snippet: output -->, <!-- snippet: file NAME --> or <!-- snippet: text: REASON -->"
            )
        elif role == "skip":
            block.problems.append("`skip` is for python / bash blocks; use `text: REASON` for others")
        block.kind = role or "invalid"
    if (block.expects or block.server_flags is not None) and block.kind not in ("python", "bash", "skip"):
        block.problems.append("`expect` and `with-server` apply to python / bash blocks only")
    if block.problems:
        block.kind = "invalid"


# ---------------------------------------------------------------------------------------------------------
# Output comparison
# ---------------------------------------------------------------------------------------------------------


def output_mismatch(shown: str, actual: str) -> str | None:
    """None when `actual` is what `shown` shows, else a message saying where it differs.

    Lines in order, trailing whitespace and trailing blank lines ignored; a line that is `...` matches
    any number of lines; a `...` inside a line matches any text within that line.
    """
    want = _lines(shown)
    got = _lines(actual)
    patterns = [None if w.strip() == "..." else _line_pattern(w) for w in want]

    @functools.cache
    def match(i: int, j: int) -> bool:
        if i == len(patterns):
            return j == len(got)
        if patterns[i] is None:
            return any(match(i + 1, k) for k in range(j, len(got) + 1))
        return j < len(got) and patterns[i].fullmatch(got[j]) is not None and match(i + 1, j + 1)

    if match(0, 0):
        return None
    # Report the first shown line that cannot be placed: the longest prefix of `want` that matches.
    best = 0
    for n in range(len(patterns), 0, -1):
        if _prefix_matches(patterns[:n], got):
            best = n
            break
    where = f"shown line {best + 1}: {want[best]!r}" if best < len(want) else "the real output has more lines"
    return f"the output differs from the block at {where}\n--- real output ---\n{actual}"


def _prefix_matches(patterns: list, got: list[str]) -> bool:
    @functools.cache
    def match(i: int, j: int) -> bool:
        if i == len(patterns):
            return True
        if patterns[i] is None:
            return any(match(i + 1, k) for k in range(j, len(got) + 1))
        return j < len(got) and patterns[i].fullmatch(got[j]) is not None and match(i + 1, j + 1)

    return match(0, 0)


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _line_pattern(line: str) -> re.Pattern[str]:
    return re.compile(".*".join(re.escape(part) for part in line.split("...")))


# ---------------------------------------------------------------------------------------------------------
# Running a page
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Result:
    returncode: int | None  # None: timed out
    stdout: str
    stderr: str
    seconds: float
    text: str  # what ran (after the server address was rewritten)

    def failure(self, block: Block) -> str | None:
        if self.returncode is None:
            return f"{block.id}: timed out after {BLOCK_TIMEOUT:.0f} s\n{self._tails()}"
        if self.returncode != 0:
            return f"{block.id}: exit code {self.returncode}\n{self._tails()}"
        for regex in block.expects:
            if not re.search(regex, self.stdout, re.MULTILINE):
                return f"{block.id}: stdout does not match expect {regex!r}\n{self._tails()}"
        return None

    def _tails(self) -> str:
        return f"--- stdout (tail) ---\n{self.stdout[-4000:]}\n--- stderr (tail) ---\n{self.stderr[-4000:]}"


class Fixtures:
    """Files a block may name, built once per session and copied into a page's directory on demand."""

    def __init__(self, cache: Path) -> None:
        self.cache = cache

    def provide(self, text: str, workdir: Path) -> None:
        for name, build in FIXTURES.items():
            if name in text and not (workdir / name).exists():
                built = self.cache / name
                if not built.exists():
                    build(built)
                target = workdir / name
                target.parent.mkdir(parents=True, exist_ok=True)
                (shutil.copytree if built.is_dir() else shutil.copy2)(built, target)


def _hf_checkpoint(out: Path) -> None:
    from tiny_models import build_tiny_model

    build_tiny_model("qwen3_moe", out)


FIXTURES = {"path/to/hf-checkpoint": _hf_checkpoint}
"""Names a block's text may use -> builder of the file or folder (the tests' tiny random models)."""


def block_env(home: Path) -> dict[str, str]:
    """The environment blocks run in: caches and config under `home`, never the user's; no network."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FREETOKEN_", "PYTEST_"))}
    env.update(
        HOME=str(home),
        XDG_CACHE_HOME=str(home / ".cache"),
        XDG_CONFIG_HOME=str(home / ".config"),
        XDG_DATA_HOME=str(home / ".local" / "share"),
        HF_HOME=str(home / ".cache" / "huggingface"),
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        PYTHONDONTWRITEBYTECODE="1",
        NO_COLOR="1",
        TERM="dumb",
        PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
    )
    env.pop("PYTHONPATH", None)
    return env


class Server:
    """`freetoken serve` on a free port, for the with-server blocks of one page."""

    def __init__(self, flags: str, workdir: Path, env: dict[str, str]) -> None:
        self.flags = flags
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log = workdir.parent / f"{workdir.name}-server.log"
        command = [*_freetoken(), "serve", "--port", str(self.port), *shlex.split(flags)]
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                command,
                cwd=workdir,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + SERVER_START_TIMEOUT
        while not self._answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"`freetoken serve {flags}` did not start:\n{self.log.read_text()[-4000:]}"
                )
            time.sleep(0.2)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _answers(self) -> bool:
        try:
            urllib.request.urlopen(f"http://{self.address}/v1/models", timeout=2).close()
        except urllib.error.HTTPError:
            return True  # answered (e.g. 401 without the API key)
        except OSError:
            return False
        return True

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def _freetoken() -> list[str]:
    script = Path(sys.executable).parent / "freetoken"
    return [str(script)] if script.exists() else [sys.executable, "-m", "freetoken_agents.cli"]


class PageRun:
    """One page's blocks, run in order in one working directory (files persist between blocks)."""

    def __init__(self, page: Page, workdir: Path, home: Path, fixtures: Fixtures) -> None:
        self.page = page
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.env = block_env(home)
        self.fixtures = fixtures
        self.results: dict[int, Result | None] = {}  # index -> result (None: not run, e.g. skipped)
        self.server: Server | None = None

    def run_through(self, index: int) -> Result | None:
        """Run (once) every block up to and including `index`; the result of block `index`."""
        for k in range(index + 1):
            if k not in self.results:
                self.results[k] = self._run(k)
        return self.results[index]

    def _run(self, index: int) -> Result | None:
        block = self.page.blocks[index]
        if block.kind == "file":
            target = self.workdir / block.file_name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(block.text, encoding="utf-8")
            return None
        if block.kind not in RUNNABLE:
            return None
        text = block.text
        if block.server_flags is not None:
            if self.server is None or self.server.flags != block.server_flags:
                self.stop_server()
                self.server = Server(block.server_flags, self.workdir, self.env)
            for spelling in SERVER_ADDRESSES:
                text = text.replace(spelling, self.server.address)
        self.fixtures.provide(text, self.workdir)
        script = (
            self.workdir.parent
            / f"{self.workdir.name}-L{block.line}.{'py' if block.kind == 'python' else 'sh'}"
        )
        script.write_text(text, encoding="utf-8")
        command = (
            [sys.executable, str(script)]
            if block.kind == "python"
            else ["bash", "-euo", "pipefail", str(script)]
        )
        start = time.monotonic()
        process = subprocess.Popen(
            command,
            cwd=self.workdir,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        try:
            stdout, stderr = process.communicate(timeout=BLOCK_TIMEOUT)
            code: int | None = process.returncode
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            code = None
        if not any(b.server_flags is not None for b in self.page.blocks[index + 1 :]):
            self.stop_server()
        return Result(code, stdout, stderr, time.monotonic() - start, text)

    def stop_server(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
