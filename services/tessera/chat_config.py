"""How a worker renders chat and how its outputs hold tool calls, as vLLM's flags say it:
--chat-template replaces the tokenizer's template (SmolLM2's ignores tools), --tool-call-parser
names the format tool_choice "auto" reads calls from. The worker applies the template and reports
both in its Info reply; the gateway parses with the parser it reports. No torch, no rpc."""
from __future__ import annotations

import pathlib
from dataclasses import dataclass, field

from tessera.config import ConfigError

# openai_api/tool_parsers.py implements each of these (a test keeps the two lists equal)
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")
SHIPPED = pathlib.Path(__file__).resolve().parent / "chat_templates"


@dataclass(frozen=True)
class ChatConfig:
    chat_template: str | None = field(default=None, metadata={
        "help": "a Jinja chat template replacing the tokenizer's: a file, the name of one shipped with Tessera "
                f"({', '.join(sorted(p.stem for p in SHIPPED.glob('*.jinja')))}), or the template itself"})
    tool_call_parser: str | None = field(default=None, metadata={
        "choices": TOOL_CALL_PARSERS,
        "help": "how tool calls appear in this model's output; tool_choice \"auto\" needs it"})
    enable_auto_tool_choice: bool = field(default=False, metadata={
        "help": "vLLM's flag, accepted for compatibility: tool_choice \"auto\" is on whenever "
                "--tool-call-parser is given, and this flag requires one"})

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser", "tool_call_parser")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ConfigError(f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}",
                              "tool_call_parser")
        if self.chat_template is not None:     # a missing file or a syntax error stops the start, before the model loads
            _check_syntax(template_text(self.chat_template))


def template_text(spec: str) -> str:
    """The template --chat-template names: an existing file, a shipped template's name, or (as
    vLLM takes it) the template text itself, recognised by its Jinja delimiters."""
    if _is_file(pathlib.Path(spec).expanduser()):
        return _read(pathlib.Path(spec).expanduser())
    if _is_file(SHIPPED / f"{spec}.jinja"):
        return _read(SHIPPED / f"{spec}.jinja")
    if "{{" in spec or "{%" in spec:
        return spec
    raise ConfigError(f"--chat-template {spec[:200]}: no such file, and not a template shipped with Tessera",
                      "chat_template")


def _is_file(path: pathlib.Path) -> bool:
    try:
        return path.is_file()
    except OSError:       # inline template text: a "path" with parts too long for the file system
        return False


def template_name(spec: str | None) -> str:
    """What the Info reply says of the template: "" for the tokenizer's own, else the file's
    name (or "inline")."""
    if spec is None:
        return ""
    return pathlib.Path(spec).name if "{{" not in spec and "{%" not in spec else "inline"


def _check_syntax(text: str) -> None:
    import jinja2
    try:     # the extension Hugging Face's template environment loads (break, continue)
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"--chat-template: line {e.lineno}: {e.message}", "chat_template") from None


def _read(path: pathlib.Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--chat-template {path}: not readable ({e})", "chat_template") from None
