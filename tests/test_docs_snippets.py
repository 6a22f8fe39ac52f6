"""Every fenced block of README.md and docs/*.md runs, or says in a directive why it does not.

The convention (implemented in tests/doc_snippets.py):

- A fence with info `python` runs as a script in a fresh `sys.executable` subprocess; `bash` runs
  with `bash -euo pipefail`. A block fails on a non-zero exit. The blocks of one page run in order,
  each in its own process, in one temporary working directory per page (a file one block writes is
  there for the next), with a per-block timeout (120 s; FREETOKEN_DOCS_TIMEOUT overrides), stdin
  empty, HOME / XDG / HF caches in a temporary home (no user cache is touched), HF_HUB_OFFLINE=1.
- Any other fence (``` alone, `text`, `json`, `toml`, ...) is never run and must be preceded by
  one directive saying what it is:
    <!-- snippet: output -->         the output (stdout) of the closest runnable block above: lines
                                      in order; `...` inside a line matches any text within it, a
                                      line that is exactly `...` any number of lines; trailing
                                      whitespace and trailing blank lines ignored
    <!-- snippet: file NAME -->       its text is written to NAME in the page's directory, for the
                                      blocks after it (allowed on a python / bash fence too)
    <!-- snippet: text: REASON -->    neither run nor compared (a directory listing...); reason required
- Before a python / bash block:
    <!-- snippet: skip: REASON -->    not run ("needs a CUDA GPU", "downloads from the Hugging Face
                                      Hub", "interactive"); the reason is required
    <!-- snippet: expect REGEX -->    (repeatable) its stdout must match (re.search, MULTILINE)
    <!-- snippet: with-server -->     `freetoken serve` (the embedded model; flags after a colon:
                                      <!-- snippet: with-server: --api-key sesame -->) is started once
                                      for the page on a free port before the block, once GET /v1/models
                                      answers; `127.0.0.1:8000` / `localhost:8000` in the block's text
                                      become its address; it stops after the page's last such block
- Directives stand alone on their lines directly above the fence (blank lines between are fine).
  An unknown directive, a directive that precedes no block, or a block with no possible
  classification fails its test and `test_every_block_is_classified`, which lists them all.
- Fixtures, put in a page's directory only when a block's text names them: `path/to/hf-checkpoint`
  (a tiny random Qwen3-MoE checkpoint with a tokenizer, tests/tiny_models.py), so that
  `freetoken convert path/to/hf-checkpoint model.ftw` runs for real. More: doc_snippets.FIXTURES.

Run one page: `python -m pytest -q tests/test_docs_snippets.py -k agents.md` (a block selected alone
runs the blocks above it on its page first, without reporting them).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from doc_snippets import Fixtures, Page, PageRun, output_mismatch, pages, read_page

PAGES: dict[str, Page] = {path: read_page(path) for path in pages()}
BLOCKS = [(page.path, index) for page in PAGES.values() for index in range(len(page.blocks))]


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, PageRun]]:
    root = tmp_path_factory.mktemp("docs-snippets")
    fixtures = Fixtures(root / "fixtures")
    home = root / "home"
    home.mkdir()
    made: dict[str, PageRun] = {}

    class Lazy(dict):
        def __missing__(self, path: str) -> PageRun:
            slug = path.replace("/", "-").removesuffix(".md")
            made[path] = self[path] = PageRun(PAGES[path], root / slug, home, fixtures)
            return made[path]

    yield Lazy()
    for run in made.values():
        run.stop_server()


def test_every_block_is_classified() -> None:
    problems = [problem for page in PAGES.values() for problem in page.problems]
    problems += [f"{b.id}: {p}" for page in PAGES.values() for b in page.blocks for p in b.problems]
    assert not problems, "blocks with no classification:\n" + "\n".join(problems)
    assert len(BLOCKS) > 0


@pytest.mark.parametrize(
    ("path", "index"), BLOCKS, ids=[PAGES[path].blocks[index].id for path, index in BLOCKS]
)
def test_block(path: str, index: int, runs: dict[str, PageRun]) -> None:
    page = PAGES[path]
    block = page.blocks[index]
    if block.kind == "invalid":
        pytest.fail(f"{block.id}: " + "; ".join(block.problems))
    if block.kind == "skip":
        pytest.skip(f"{block.id}: {block.reason}")
    if block.kind == "text":
        return
    run = runs[path]
    if block.kind == "output":
        assert block.shows is not None
        shown = page.blocks[block.shows]
        if shown.kind == "skip":
            pytest.skip(f"{block.id}: the output of {shown.id}, which is skipped: {shown.reason}")
        result = run.run_through(block.shows)
        assert result is not None
        failure = result.failure(shown)
        if failure:
            pytest.fail(f"{block.id} shows the output of a block that failed: {failure}")
        mismatch = output_mismatch(block.text, result.stdout)
        if mismatch:
            pytest.fail(f"{block.id} (the output of {shown.id}): {mismatch}")
        return
    result = run.run_through(index)
    if block.kind == "file":
        assert (run.workdir / block.file_name).exists()
        return
    assert result is not None
    failure = result.failure(block)
    if failure:
        pytest.fail(failure)


def test_output_matching() -> None:
    """The matching rules of `<!-- snippet: output -->` blocks."""
    assert output_mismatch("a\nb ...\n...\nz\n", "a\nb 1.2 s\nc\nd\nz\n\n") is None
    assert output_mismatch("a\n...\n", "a\n") is None
    assert output_mismatch("loaded in ... s", "loaded in 0.4 s  ") is None
    assert output_mismatch("a\nb\n", "a\nc\n") is not None
    assert output_mismatch("a\n", "a\nb\n") is not None
    assert output_mismatch("x(...)", "x(1)\n") is None and output_mismatch("x(...)", "y(1)") is not None


def test_page_parsing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Directives classify blocks; a missing reason, an unknown directive or a bare fence is a problem."""
    import doc_snippets

    (tmp_path / "p.md").write_text(
        "```bash\necho hi\n```\n\n<!-- snippet: output -->\n```\nhi\n```\n\n"
        "<!-- snippet: skip: needs a CUDA GPU -->\n```python\nimport torch\n```\n\n"
        "<!-- snippet: expect ^2$ -->\n<!-- snippet: with-server: --api-key k -->\n```python\nprint(2)\n```\n"
        "<!-- snippet: skip -->\n```bash\nx\n```\n<!-- snippet: frobnicate -->\n```python\ny\n```\n"
        "```json\n{}\n```\n<!-- snippet: file a.toml -->\n```toml\nk = 1\n```\n"
        "<!-- snippet: text: a listing -->\n\n```\nsrc/\n```\n<!-- snippet: output -->\nprose\n",
        encoding="utf-8",
    )
    monkeypatch.setattr(doc_snippets, "ROOT", tmp_path)
    page = read_page("p.md")
    kinds = [(b.line, b.kind) for b in page.blocks]
    assert kinds == [
        (1, "bash"),
        (6, "output"),
        (11, "skip"),
        (17, "python"),
        (21, "invalid"),
        (25, "invalid"),
        (28, "invalid"),
        (32, "file"),
        (37, "text"),
    ]
    assert page.blocks[1].shows == 0 and page.blocks[3].server_flags == "--api-key k"
    assert page.blocks[3].expects == ["^2$"] and page.blocks[2].reason == "needs a CUDA GPU"
    assert "needs a reason" in page.blocks[4].problems[0] and "unknown" in page.blocks[5].problems[0]
    assert len(page.problems) == 1 and "not directly followed" in page.problems[0]
