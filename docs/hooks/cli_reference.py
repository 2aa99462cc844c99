"""MkDocs hook: docs/reference/cli.md, written at build time from tessera.cli.build_parser(), the
parser `tessera` itself runs, so the reference cannot drift from the code. For `tessera` and
every command and nested command: the usage line, the description and a table of its options
(flags, default, choices, help). render() returns the page; tests/test_docs_reference.py
checks it covers every command and option string."""
from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import re
import sys

PAGE = "reference/cli.md"
USAGE_WIDTH = 100
ROOT = pathlib.Path(__file__).resolve().parents[2]


def import_tessera_cli():
    """tessera.cli from the installed package (the venv's editable install), else from this
    checkout's services/ and kernels/ (a mkdocs outside the venv)."""
    try:
        import tessera.cli as cli
    except ImportError:
        sys.path[:0] = [str(ROOT / "services"), str(ROOT / "kernels")]
        import tessera.cli as cli
    return cli


@contextlib.contextmanager
def _plain_environment():
    """Some defaults come from $TESSERA_* variables (e.g. $TESSERA_REGISTRY): build the parser
    without them, so the page shows the defaults of a clean environment, not the builder's."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("TESSERA_")}
    try:
        yield
    finally:
        os.environ.update(saved)


def build_parser() -> argparse.ArgumentParser:
    with _plain_environment():
        return import_tessera_cli().build_parser()


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("tessera",), text: str | None = None):
    """(path, parser, description) for the parser and every command below it, depth first."""
    yield path, parser, parser.description or text
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield from commands(sub, path + (name,), helps.get(name))


def anchor(path: tuple[str, ...]) -> str:
    return "-".join(path)


def _cell(text: str) -> str:
    """Text for a table cell on one line, Markdown escaped outside `code spans` (a table
    splits cells at pipes outside code spans only)."""
    parts = re.split(r"(`[^`]*`)", " ".join(str(text).split()))
    return "".join(p if p.startswith("`") else _escape(p) for p in parts)


def _escape(text: str) -> str:
    text = re.sub(r"([\\*_\[\]|])", r"\\\1", text)
    return text.replace("<", "&lt;").replace(">", "&gt;")


def _code(value) -> str:
    text = str(value).replace("`", "'")
    return f"`{text}`" if text else ""


def _default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    default = action.default
    if default in (None, argparse.SUPPRESS) or isinstance(action, argparse._HelpAction):
        return ""
    if isinstance(default, (list, tuple)):
        default = ",".join(map(str, default))
    return _code(default)


def _help(action: argparse.Action, formatter: argparse.HelpFormatter) -> str:
    """The help as `--help` prints it, less a trailing "(default: X)" the Default column shows."""
    if not action.help or action.help == argparse.SUPPRESS:
        text = ""
    else:
        text = formatter._expand_help(action)
    shown = _default(action).strip("`")
    if shown:
        text = re.sub(r"\s*\(default: " + re.escape(shown) + r"\)$", "", text)
    if isinstance(action, argparse._AppendAction) and "repeatable" not in text:
        text = (text + " (repeatable)").strip()
    return _cell(text)


def _option(action: argparse.Action) -> str:
    names = action.option_strings or [action.metavar or action.dest]
    kind = getattr(action.type, "__name__", None) if action.type in (int, float, str) else None
    return ", ".join(_code(n) for n in names) + (f" *{kind}*" if kind else "")


def _options_table(parser: argparse.ArgumentParser) -> list[str]:
    formatter = parser._get_formatter()
    rows = ["| Option | Default | Choices | Description |", "|---|---|---|---|"]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            continue
        choices = ", ".join(_code(c) for c in action.choices) if action.choices else ""
        rows.append(f"| {_option(action)} | {_default(action)} | {choices} | {_help(action, formatter)} |")
    return rows


def _usage(parser: argparse.ArgumentParser) -> str:
    formatter = parser.formatter_class(prog=parser.prog, width=USAGE_WIDTH)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return formatter.format_help().strip()


def _subcommands(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            rows = ["| Command | What it does |", "|---|---|"]
            for choice in action._choices_actions:
                sub = path + (choice.dest,)
                rows.append(f"| [`{' '.join(sub)}`](#{anchor(sub)}) | {_cell(choice.help or '')} |")
    return rows


def render(parser: argparse.ArgumentParser | None = None) -> str:
    """The whole page, from `parser` (default: tessera's own)."""
    parser = parser or build_parser()
    out = ["# Command line", "",
           "Generated at build time from the argument parsers `tessera` runs (`tessera.cli.build_parser`), "
           "so it lists exactly what `tessera COMMAND --help` prints. Flags named after a configuration "
           "field are generated from the config dataclasses; [Configuration](../configuration.md) explains "
           "them by topic. Defaults are those of an environment with no `TESSERA_*` variables set.", ""]
    for path, sub, text in commands(parser):
        level = "##" if len(path) <= 2 else "###"
        out += [f"{level} {' '.join(path)} {{#{anchor(path)}}}", ""]
        if text and len(path) > 1:     # tessera's own description is its module docstring's first line
            out += [_cell(text), ""]
        out += ["```text", _usage(sub), "```", ""]
        rows = _subcommands(sub, path)
        if rows:
            out += [*rows, ""]
        out += [*_options_table(sub), ""]
    return "\n".join(out)


def on_files(files, config):
    from mkdocs.structure.files import File
    existing = files.get_file_from_path(PAGE)
    if existing is not None:
        files.remove(existing)
    files.append(File.generated(config, PAGE, content=render()))
    return files
