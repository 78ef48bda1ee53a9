"""The documentation's code: every block is quoted from a program that runs, or runs on its own.

The pages are ``README.md`` and ``docs/*.md`` (the documentation site's pages).

* A fenced block introduced by ``<!-- quote: FILE readme:NAME [readme:NAME ...] -->``
  must equal those regions of ``FILE``: the lines between ``# [readme:NAME]`` and
  ``# [/readme:NAME]``, dedented, several regions joined by one blank line.
* A fenced block introduced by ``<!-- runnable -->`` is complete on its own and runs
  in one process (no process group).
* Every marked region of ``examples/`` is quoted exactly once over all pages, every
  quote names regions that exist, and every ``python`` block is quoted or runnable.
* The programs the blocks quote (``examples/readme_quickstart.py``, the README's
  quickstart; ``examples/quickstart.py``; ``examples/ordinary_torch.py``) run under
  torchrun on 2 ranks with the command a page gives and exit 0; each checks itself
  against unsharded torch (one launch per program).
* The README stays short: at most 12 KB, its quickstart at most 40 lines.

A block that differs from its region fails with a diff; update the page from the
example (the example runs; the page is its quote).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import io
import re
import shlex
import textwrap
from pathlib import Path

import pytest

from .harness import ROOT, run_python

README = ROOT / "README.md"
DOCS = ROOT / "docs"
EXAMPLES = ROOT / "examples"
QUICKSTART = "examples/quickstart.py"
README_QUICKSTART = "examples/readme_quickstart.py"
README_MAX_BYTES = 12 * 1024
README_QUICKSTART_MAX_LINES = 40
LAUNCH_TIMEOUT = 180  # seconds for the one torchrun launch; the test's mark allows a little more

QUOTE = re.compile(r"^<!-- quote: (\S+)((?: readme:[\w-]+)+) -->$")
RUNNABLE = "<!-- runnable -->"
FENCE = re.compile(r"^```(\w*)\s*$")
HEADING = re.compile(r"^#{1,6} (.*)$")
OPEN = re.compile(r"^(\s*)# \[readme:([\w-]+)\]\s*$")
CLOSE = re.compile(r"^(\s*)# \[/readme:([\w-]+)\]\s*$")
MARKER_LIKE = re.compile(r"^\s*#.*\[/?readme:")  # a comment that looks like a marker but is not one


def pages() -> list[Path]:
    """The pages whose code is checked: the README and every page of the documentation site."""
    return [README, *sorted(DOCS.rglob("*.md"))]


@dataclasses.dataclass(frozen=True)
class Block:
    """A fenced block of a page and the comment that introduces it."""

    page: str  # the page's path from the checkout's root
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    section: str
    directive: str | None  # the HTML comment on the line before the fence (blank lines skipped)


def readme_blocks(text: str, page: str = "README.md") -> list[Block]:
    """Every fenced block of ``text`` (the page ``page``), with its section heading and introducing comment."""
    blocks = []
    lines = text.splitlines()
    section, i = "", 0
    while i < len(lines):
        if m := HEADING.match(lines[i]):
            section = m[1].strip()
        elif m := FENCE.match(lines[i]):
            start = i
            i += 1
            while i < len(lines) and lines[i].rstrip() != "```":
                i += 1
            if i == len(lines):
                raise AssertionError(f"{page}:{start + 1}: a fence that is never closed")
            before = [line.strip() for line in lines[:start] if line.strip()][-1:]
            directive = before[0] if before and before[0].startswith("<!--") else None
            blocks.append(Block(page, start + 1, m[1], "\n".join(lines[start + 1 : i]), section, directive))
        i += 1
    return blocks


def file_regions(path: Path) -> tuple[dict[str, str], list[str]]:
    """The marked regions of ``path`` (name -> dedented text) and the problems with its markers."""
    regions: dict[str, str] = {}
    problems: list[str] = []
    current: tuple[str, str, int] | None = None  # name, indent, first line index
    lines = path.read_text().splitlines()
    where = path.relative_to(ROOT)
    for i, line in enumerate(lines):
        if m := OPEN.match(line):
            if current is not None:
                problems.append(f"{where}:{i + 1}: region {m[2]!r} opens inside region {current[0]!r}")
            elif m[2] in regions:
                problems.append(f"{where}:{i + 1}: region {m[2]!r} is marked twice")
            current = (m[2], m[1], i + 1)
        elif m := CLOSE.match(line):
            if current is None or m[2] != current[0]:
                problems.append(f"{where}:{i + 1}: {line.strip()!r} closes no open region of that name")
                continue
            if m[1] != current[1]:
                problems.append(f"{where}:{i + 1}: region {m[2]!r} closes at another indentation than it opens")
            body = textwrap.dedent("\n".join(lines[current[2] : i])).strip("\n")
            regions[m[2]] = body
            current = None
        elif MARKER_LIKE.match(line):
            problems.append(f"{where}:{i + 1}: a malformed marker: {line.strip()!r}")
    if current is not None:
        problems.append(f"{where}:{current[2]}: region {current[0]!r} is never closed")
    return regions, problems


def example_regions() -> tuple[dict[tuple[str, str], str], list[str]]:
    """Every marked region under ``examples/``: ``(file, region) -> text``, and the markers' problems."""
    found: dict[tuple[str, str], str] = {}
    problems: list[str] = []
    for path in sorted(EXAMPLES.rglob("*.py")):
        regions, bad = file_regions(path)
        problems += bad
        found.update({(str(path.relative_to(ROOT)), name): text for name, text in regions.items()})
    return found, problems


def quotes(blocks: list[Block]) -> list[tuple[Block, str, list[str]]]:
    """The quoted blocks: (block, file, region names)."""
    out = []
    for b in blocks:
        if b.directive is not None and (m := QUOTE.match(b.directive)):
            out.append((b, m[1], [r.removeprefix("readme:") for r in m[2].split()]))
    return out


def diff(want: str, got: str, block: Block) -> str:
    return "\n".join(difflib.unified_diff(want.splitlines(), got.splitlines(), "the example's regions",
                                          f"{block.page}:{block.line}", lineterm=""))


@pytest.fixture(scope="module")
def blocks() -> list[Block]:
    """The fenced blocks of every page, in page order."""
    return [b for page in pages() for b in readme_blocks(page.read_text(), str(page.relative_to(ROOT)))]


# ------------------------------------------------------------------ (a) quotes equal their regions
def test_quoted_blocks_equal_the_example_regions(blocks):
    regions, _ = example_regions()
    quoted = quotes(blocks)
    assert quoted, "no block of the pages is quoted from an example"
    stale = []
    for block, path, names in quoted:
        if any((path, n) not in regions for n in names):
            continue  # a missing region is reported by test_markers_and_quotes_match
        want = "\n\n".join(regions[(path, n)] for n in names)
        if block.text != want:
            stale.append(f"{block.page}:{block.line} ({block.section!r}) differs from {path} "
                         f"{' '.join(names)}:\n{diff(want, block.text, block)}")
    if stale:
        pytest.fail("quoted blocks out of date (copy the regions into the pages):\n\n" + "\n\n".join(stale))


# ------------------------------------------------------------------ (d) markers and quotes match
def test_markers_and_quotes_match(blocks):
    regions, problems = example_regions()
    seen: dict[tuple[str, str], list[str]] = {}
    for block, path, names in quotes(blocks):
        if block.lang != "python":
            problems.append(f"{block.page}:{block.line}: a quoted block must be ```python, not ```{block.lang}")
        for n in names:
            seen.setdefault((path, n), []).append(f"{block.page}:{block.line}")
            if (path, n) not in regions:
                problems.append(f"{block.page}:{block.line}: quotes {path} region {n!r}, which has no markers")
    for key in sorted(regions):
        where = seen.get(key, [])
        if len(where) != 1:
            problems.append(f"{key[0]} region {key[1]!r} is quoted {len(where)} times ({where}); every region "
                            "is quoted exactly once, in README.md or a page of docs/")
    for b in blocks:
        if b.directive is not None and b.directive.startswith("<!-- quote") and not QUOTE.match(b.directive):
            problems.append(f"{b.page}:{b.line}: malformed quote comment {b.directive!r}")
    assert regions, "no marked region under examples/"
    if problems:
        pytest.fail("\n".join(problems))


def test_python_blocks_are_quoted_or_runnable(blocks):
    loose = [f"{b.page}:{b.line} (section {b.section!r})" for b in blocks
             if b.lang == "python"
             and not (b.directive == RUNNABLE or (b.directive and QUOTE.match(b.directive)))]
    if loose:
        pytest.fail("python blocks neither quoted from an example (<!-- quote: FILE readme:NAME -->) nor marked "
                    "<!-- runnable -->: " + ", ".join(loose))


# ------------------------------------------------------------------ (b) runnable blocks run
def test_runnable_blocks_run(blocks):
    runnable = [b for b in blocks if b.directive == RUNNABLE]
    assert runnable, "no block of the pages is marked <!-- runnable -->"
    for b in runnable:
        assert b.lang == "python", f"{b.page}:{b.line}: only python blocks can be runnable"
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(b.text, f"{b.page}:{b.line}", "exec"), {"__name__": "__readme__"})  # noqa: S102
        assert out.getvalue().strip(), f"{b.page}:{b.line}: printed nothing"


# ------------------------------------------------------------------ the README stays short
def test_readme_is_short_and_its_quickstart_fits_forty_lines(blocks):
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, (f"README.md is {size} bytes, over {README_MAX_BYTES}: move detail to a page "
                                      "of docs/ and link it")
    quickstart = [b for b, path, _ in quotes(blocks) if b.page == "README.md" and path == README_QUICKSTART]
    assert len(quickstart) == 1, f"README.md quotes {README_QUICKSTART} {len(quickstart)} times, not once"
    lines = quickstart[0].text.count("\n") + 1
    assert lines <= README_QUICKSTART_MAX_LINES, f"the README's quickstart is {lines} lines, over 40"


# ------------------------------------------------------------------ (c) the quoted programs run
def readme_command(script: str) -> list[str]:
    """The command a page gives (in backticks) that runs ``script``, as argv."""
    for page in pages():
        commands = re.findall(r"`(\.venv/bin/python [^`]*?" + re.escape(script) + r")`", page.read_text())
        if commands:
            return shlex.split(commands[0])
    raise AssertionError(f"no page gives a `.venv/bin/python ... {script}` command")


@pytest.mark.timeout(LAUNCH_TIMEOUT + 20)
def test_readme_quickstart_runs_on_two_ranks():
    argv = readme_command(README_QUICKSTART)
    assert "--nproc_per_node=2" in argv and argv[0] == ".venv/bin/python", argv
    assert README_QUICKSTART in README.read_text(), "the README gives its quickstart's command"
    res = run_python(argv[1:], timeout=LAUNCH_TIMEOUT)  # .venv/bin/python: this interpreter
    assert res.returncode == 0, f"exit {res.returncode}\n--- stdout\n{res.stdout}\n--- stderr\n{res.stderr[-6000:]}"
    assert "user: 13x8 torch.float32, row_wise, 2 shard(s)" in res.stdout, res.stdout  # the picture
    assert "model.embedding_bags.user.weight" in res.stdout, res.stdout  # the checkpoint's report


@pytest.mark.timeout(LAUNCH_TIMEOUT + 20)
def test_quickstart_runs_on_two_ranks():
    argv = readme_command(QUICKSTART)
    assert "--nproc_per_node=2" in argv and argv[0] == ".venv/bin/python", argv
    res = run_python(argv[1:], timeout=LAUNCH_TIMEOUT)  # .venv/bin/python: this interpreter
    assert res.returncode == 0, f"exit {res.returncode}\n--- stdout\n{res.stdout}\n--- stderr\n{res.stderr[-6000:]}"
    assert "quickstart: every check passed on 2 ranks" in res.stdout, res.stdout
    for step in ("tour:", "lookups:", "training:", "interop:", "checkpoints:", "submodule:"):
        assert step in res.stdout, f"step {step!r} did not report\n{res.stdout}"


@pytest.mark.timeout(LAUNCH_TIMEOUT + 20)
def test_ordinary_torch_example_runs_on_two_ranks():
    argv = readme_command("examples/ordinary_torch.py")
    assert "--nproc_per_node=2" in argv and argv[0] == ".venv/bin/python", argv
    res = run_python(argv[1:], timeout=LAUNCH_TIMEOUT)
    assert res.returncode == 0, f"exit {res.returncode}\n--- stdout\n{res.stdout}\n--- stderr\n{res.stderr[-6000:]}"
    assert "ordinary torch: every check passed on 2 ranks" in res.stdout, res.stdout
