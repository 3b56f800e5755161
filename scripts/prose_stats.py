"""Sentence lengths of the project's docstrings and docs, and its longest module docstrings.

Usage: python scripts/prose_stats.py [--worst N] [--json FILE]

A sentence ends at ``.``, ``?`` or ``!`` before a space or the end of a paragraph, or at a
blank line; code blocks, tables, headings and doctest lines are left out, and list items
count as sentences of their own.
"""
from __future__ import annotations

import argparse
import ast
import json
import re
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE = ("megatron_adacc", "scripts", "pretrain_gpt.py", "examples")
DOCS = ("README.md", "docs")
MODULE_DOCSTRING_LINES = 25

_SENTENCE_END = re.compile(r"(?<=[.?!])\s+(?=[A-Z`(\"'*\d-])")
_WORD = re.compile(r"[A-Za-z0-9_`'][\w`'./:+-]*")


def files_under(names: tuple[str, ...], suffix: str) -> list[Path]:
    """Each named file, and every ``*suffix`` file under each named folder, sorted per folder."""
    files: list[Path] = []
    for name in names:
        path = ROOT / name
        files += [path] if path.is_file() else sorted(path.rglob(f"*{suffix}"))
    return files


def docstrings(path: Path) -> list[str]:
    """Every module, class and function docstring of ``path``."""
    tree = ast.parse(path.read_text())
    nodes = [tree, *(node for node in ast.walk(tree) if isinstance(
        node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))]
    return [text for node in nodes if (text := ast.get_docstring(node))]


def prose_of_markdown(text: str) -> str:
    """The paragraphs of a Markdown page, without its code, tables and headings."""
    kept, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        stripped = line.strip()
        if fenced or stripped.startswith(("|", "#", "<")):
            kept.append("")
            continue
        kept.append(line)
    return "\n".join(kept)


def sentences(text: str) -> list[str]:
    """``text`` cut into sentences: paragraphs, list items and ``Args:`` entries apart."""
    out = []
    block: list[str] = []

    def flush():
        if block:
            out.extend(part for part in _SENTENCE_END.split(" ".join(block)) if part)
            block.clear()

    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith(">>>"):
            flush()
            continue
        if re.match(r"([-*+]|\d+\.)\s", stripped) or re.match(r"\w+( \(.*\))?:\s", stripped) \
                or stripped.endswith(":") and len(stripped.split()) <= 2:
            flush()
        block.append(stripped)
    flush()
    return [sentence for sentence in out if _WORD.search(sentence)]


def words(sentence: str) -> int:
    return len(_WORD.findall(re.sub(r"^([-*+]|\d+\.)\s+", "", sentence)))


def measure(worst: int) -> dict:
    lengths: list[tuple[int, str, str]] = []
    long_modules = []
    for path in files_under(CODE, ".py"):
        name = str(path.relative_to(ROOT))
        for text in docstrings(path):
            lengths += [(words(s), name, s) for s in sentences(text)]
        module = ast.get_docstring(ast.parse(path.read_text()))
        if module and len(module.splitlines()) > MODULE_DOCSTRING_LINES:
            long_modules.append((len(module.splitlines()), name))
    for path in files_under(DOCS, ".md"):
        name = str(path.relative_to(ROOT))
        lengths += [(words(s), name, s) for s in sentences(prose_of_markdown(path.read_text()))]
    counts = sorted(count for count, _, _ in lengths)
    return {
        "sentences": len(counts),
        "mean_words": round(statistics.fmean(counts), 2),
        "p90_words": counts[int(0.9 * (len(counts) - 1))],
        "module_docstrings_over_limit": sorted(long_modules, reverse=True),
        "longest": [{"words": n, "file": f, "sentence": s[:160]}
                    for n, f, s in sorted(lengths, reverse=True)[:worst]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worst", type=int, default=10, help="longest sentences to list")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    result = measure(args.worst)
    print(f"{result['sentences']} sentences: mean {result['mean_words']} words, "
          f"p90 {result['p90_words']}")
    over = result["module_docstrings_over_limit"]
    print(f"module docstrings over {MODULE_DOCSTRING_LINES} lines: {len(over)}")
    for lines, name in over:
        print(f"  {lines:4d}  {name}")
    print("longest sentences:")
    for row in result["longest"]:
        print(f"  {row['words']:4d}  {row['file']}: {row['sentence']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
