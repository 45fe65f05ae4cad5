"""Copies benchmark results into the pages that include them.

Every figure in README.md and docs/*.md comes from a file in
benchmarks/results/, which the benchmarks write. A page includes such a file
(or one section of it) between two markers:

    <!-- results: benchmarks/results/microbatched.md -->
    (the file's text, written here by this script)
    <!-- /results -->

`path#slug` includes one section of the file: the lines under the heading
whose slug is `slug` (lower case, spaces as `-`, punctuation dropped, as
GitHub and mkdocs make anchors), up to the next heading of the same or a
higher level.

    python docs/sync_docs.py          # rewrite the included text
    python docs/sync_docs.py --check  # change nothing; exit 1 if stale

tests/test_docs.py runs the check, so a page cannot disagree with the last
benchmark run.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Markers stand alone on their lines.
INCLUDE = re.compile(
    r"^(?P<open><!-- results: (?P<target>[^\s#]+)(?:#(?P<section>[\w-]+))? -->\n)"
    r"(?P<body>.*?)"
    r"^(?P<close><!-- /results -->)$",
    re.DOTALL | re.MULTILINE,
)
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def pages(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    """The pages that may include results: README.md and docs/*.md."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def slug(heading: str) -> str:
    text = re.sub(r"[^\w\s-]", "", heading.strip().lower())
    return re.sub(r"\s+", "-", text)


def results_text(root: pathlib.Path, target: str, section: str | None = None) -> str:
    """The text a marker includes: the whole results file, or one section."""
    path = root / target
    if not path.is_file():
        raise FileNotFoundError(f"included results file {target} does not exist")
    text = path.read_text()
    if section is None:
        return text.strip("\n")
    lines = text.splitlines()
    for start, line in enumerate(lines):
        match = HEADING.match(line)
        if match and slug(match.group(2)) == section:
            level = len(match.group(1))
            end = start + 1
            while end < len(lines):
                other = HEADING.match(lines[end])
                if other and len(other.group(1)) <= level:
                    break
                end += 1
            return "\n".join(lines[start + 1 : end]).strip("\n")
    raise KeyError(f"{target} has no heading whose slug is {section!r}")


def synced(text: str, root: pathlib.Path = ROOT) -> str:
    """`text` with the body of every include marker replaced by its file's text."""

    def replace(match: re.Match) -> str:
        body = results_text(root, match["target"], match["section"])
        return f"{match['open']}\n{body}\n\n{match['close']}"

    return INCLUDE.sub(replace, text)


def stale_pages(root: pathlib.Path = ROOT) -> list[str]:
    """The pages whose included text differs from the results files, each
    with the includes that differ."""
    stale = []
    for page in pages(root):
        text = page.read_text()
        if synced(text, root) != text:
            targets = [
                m["target"] + (f"#{m['section']}" if m["section"] else "")
                for m in INCLUDE.finditer(text)
                if synced(m.group(0), root) != m.group(0)
            ]
            stale.append(f"{page.relative_to(root)}: {', '.join(targets)}")
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="change nothing; exit 1 if stale"
    )
    args = parser.parse_args(argv)
    stale = stale_pages()
    if args.check:
        for line in stale:
            print(f"out of date: {line}")
        if stale:
            print("run `python docs/sync_docs.py` to refresh them")
        return 1 if stale else 0
    for page in pages():
        text = page.read_text()
        new = synced(text)
        if new != text:
            page.write_text(new)
            print(f"updated {page.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
