"""Generate docs/configuration.md — every setting EvalForge reads — from the code itself.

    .venv/bin/python scripts/gen_config_docs.py           rewrite docs/configuration.md
    .venv/bin/python scripts/gen_config_docs.py --check   exit 1 if the file is out of date

What it reads, at run time, so that a new setting shows up without editing this script:

- every pydantic-settings class (a ``BaseSettings`` subclass) defined in a module under
  ``services/``, ``trainer/`` or ``benchmarks/``, found by scanning the sources for
  ``BaseSettings``; each field's environment variable names are the ones
  pydantic-settings itself resolves (prefix, aliases);
- the command lines of ``evalforge`` and ``policy-server`` (the policy server's flags
  override its ``POLICY_SERVER_*`` settings);
- the variables ``compose.yaml`` interpolates, with their defaults.

``tests/test_config_docs.py`` fails when the file differs from what this writes, and
``tests/test_compose.py`` checks compose.yaml's environment against :func:`settings_env`.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings, EnvSettingsSource

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "configuration.md"
COMPOSE = REPO / "compose.yaml"
PACKAGES = ("services", "trainer", "benchmarks")
# The commands that run the services, and so configure a deployment; client verbs
# (`evalforge eval …`, `policy …`) document themselves with --help.
CLIS = (("evalforge", "services.cli", ("api", "worker", "sweeper", "up")),
        ("policy-server", "services.policy_server.cli", ()))

if str(REPO) not in sys.path:  # run as a script from anywhere: our packages import from the root
    sys.path.insert(0, str(REPO))


# --- settings classes -------------------------------------------------------------------


def settings_classes() -> list[type[BaseSettings]]:
    """Every ``BaseSettings`` subclass defined in our packages, in module order."""
    found: list[type[BaseSettings]] = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            if "BaseSettings" not in path.read_text(encoding="utf-8"):
                continue
            module_name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            module = importlib.import_module(module_name)
            found.extend(cls for _, cls in inspect.getmembers(module, inspect.isclass)
                         if issubclass(cls, BaseSettings) and cls is not BaseSettings
                         and cls.__module__ == module_name)
    return found


def env_names(cls: type[BaseSettings], field_name: str) -> list[str]:
    """The environment variables that set ``field_name`` of ``cls``, the preferred one first.

    pydantic-settings' own resolution (``EnvSettingsSource._extract_field_info``) decides,
    so aliases, prefixes and ``populate_by_name`` mean here what they mean at run time.
    """
    source = EnvSettingsSource(cls)
    resolved = source._extract_field_info(cls.model_fields[field_name], field_name)
    names = [env_name if cls.model_config.get("case_sensitive") else env_name.upper()
             for _, env_name, _ in resolved]
    return list(dict.fromkeys(names))


@dataclass(frozen=True)
class Setting:
    """One field of a settings class and the environment variables that set it."""

    cls: type[BaseSettings]
    name: str
    field: FieldInfo
    env: tuple[str, ...]


def settings() -> Iterator[Setting]:
    for cls in settings_classes():
        for name, field in cls.model_fields.items():
            yield Setting(cls, name, field, tuple(env_names(cls, name)))


def settings_env() -> dict[str, list[Setting]]:
    """Environment variable name → the settings it sets (a name can serve several classes)."""
    by_name: dict[str, list[Setting]] = {}
    for setting in settings():
        for name in setting.env:
            by_name.setdefault(name, []).append(setting)
    return by_name


# --- compose.yaml variables --------------------------------------------------------------

# Compose's interpolation: $$ is a literal $, ${NAME}, ${NAME:-default}, ${NAME-default},
# ${NAME:?error}, ${NAME?error}, ${NAME:+alternative}, ${NAME+alternative}, and bare $NAME.
_INTERPOLATION = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[_a-zA-Z][_a-zA-Z0-9]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|(?P<named>[_a-zA-Z][_a-zA-Z0-9]*))")


class InterpolationError(ValueError):
    """A compose value names a variable that has no default and is not set."""


def interpolate(text: str, environ: dict[str, str]) -> str:
    """``text`` with compose's ``${…}`` substitutions done against ``environ`` (not os.environ).

    A variable that is unset and has no default is an error here, where compose would
    substitute an empty string with a warning: every variable compose.yaml reads must
    work without an ``.env`` file.
    """
    def substitute(match: re.Match[str]) -> str:
        if match["escaped"]:
            return "$"
        name = match["braced"] or match["named"]
        op, arg = match["op"] or "", match["arg"] or ""
        value = environ.get(name)
        is_set = value is not None and (value != "" or ":" not in op)
        if op.endswith("+"):
            return arg if is_set else ""
        if is_set:
            return value
        if op.endswith("-"):
            return arg
        raise InterpolationError(f"${{{name}}} in {text!r} has no default and {name} is not set: "
                                 f"write ${{{name}:-DEFAULT}} so that compose.yaml works without an .env file")
    return _INTERPOLATION.sub(substitute, text)


def compose_variables(text: str) -> dict[str, str | None]:
    """Variables compose.yaml interpolates → their default (None: no default), in order of appearance."""
    found: dict[str, str | None] = {}
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        for match in _INTERPOLATION.finditer(line):
            name = match["braced"] or match["named"]
            if name and name not in found:
                found[name] = match["arg"] if (match["op"] or "").endswith("-") else None
    return found


# --- rendering ---------------------------------------------------------------------------


def _type_name(annotation: Any) -> str:
    return annotation.__name__ if isinstance(annotation, type) else str(annotation).replace("typing.", "")


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "**required**"
    else:
        value = field.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


_BOUNDS = (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤"))


def _bounds(field: FieldInfo) -> str:
    parts = [f"{symbol} {getattr(item, attr)}" for item in field.metadata
             for attr, symbol in _BOUNDS if getattr(item, attr, None) is not None]
    return f" ({', '.join(parts)})" if parts else ""


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _first_line(doc: str | None) -> str:
    return inspect.cleandoc(doc or "").split("\n\n")[0].replace("\n", " ")


def render_settings() -> list[str]:
    lines: list[str] = []
    for cls in settings_classes():
        lines += [f"### `{cls.__name__}` — `{cls.__module__}`", "", _first_line(cls.__doc__), "",
                  "| Variable | Default | Type | What it does |", "|---|---|---|---|"]
        for name, field in cls.model_fields.items():
            first, *others = env_names(cls, name)
            variable = f"`{first}`" + (f" (or {', '.join(f'`{n}`' for n in others)})" if others else "")
            description = _cell((field.description or "(no description)") + _bounds(field))
            lines.append(f"| {variable} | {_default(field)} | `{_type_name(field.annotation)}` | {description} |")
        lines.append("")
    return lines


def render_client() -> list[str]:
    """The variables of the command-line client (``services/client.py``), which is not a settings class."""
    from services import client

    return ["### Client — `services.client`", "",
            "Read by `evalforge eval|policy|leaderboard` and `EvalForgeClient`; `--api-url` and `--api-key` "
            "override them.", "", "| Variable | Default | What it does |", "|---|---|---|",
            f"| `{client.API_URL_ENV}` | `{client.DEFAULT_API_URL}` | The evaluation API the client talks to. |",
            f"| `{client.API_KEY_ENV}` | unset | API key for writes (`evalforge apikey create`). |", ""]


def _parsers(prog: str, parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """The parser and, depth first, every sub-command's parser, each with its command line."""
    yield prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for verb, sub in action.choices.items():
                yield from _parsers(f"{prog} {verb}", sub)


def render_cli(prog: str, module_name: str, verbs: tuple[str, ...]) -> list[str]:
    """Flag tables of ``prog`` itself (no ``verbs``) or of those of its verbs that exist."""
    module = importlib.import_module(module_name)
    wanted = {f"{prog} {verb}" for verb in verbs} if verbs else {prog}
    lines: list[str] = []
    for command, parser in _parsers(prog, module.build_parser()):
        if command not in wanted:
            continue
        options = [a for a in parser._actions
                   if a.option_strings and not isinstance(a, argparse._HelpAction)]
        if not options:
            continue
        lines += [f"### `{command}`", "", "| Flag | Default | What it does |", "|---|---|---|"]
        for action in options:
            if action.default is None or action.default is argparse.SUPPRESS:
                default = "required" if action.required else "unset"
            elif isinstance(action.default, bool):
                default = f"`{str(action.default).lower()}`"
            else:
                default = f"`{action.default}`"
            help_text = (action.help or "").replace("%(default)s", str(action.default))
            if action.choices and not isinstance(action, argparse._SubParsersAction):
                help_text += f" (one of {', '.join(str(c) for c in action.choices)})"
            lines.append(f"| `{', '.join(action.option_strings)}` | {default} | {_cell(help_text)} |")
        lines.append("")
    return lines


def render_compose() -> list[str]:
    variables = compose_variables(COMPOSE.read_text(encoding="utf-8"))
    lines = ["| Variable | Default |", "|---|---|"]
    lines += [f"| `{name}` | {'required' if default is None else f'`{default}`' if default else 'empty'} |"
              for name, default in variables.items()]
    return [*lines, ""]


HEADER = """\
<!-- Generated by scripts/gen_config_docs.py from the code; do not edit by hand.
     After changing a setting or a flag, run: .venv/bin/python scripts/gen_config_docs.py -->
# Configuration reference

Every setting EvalForge reads, with its default. Services read their settings from the
environment once, when the process starts (pydantic-settings; names are
case-insensitive; booleans take `1`/`0`/`true`/`false`). The policy server's
command-line flags override its `POLICY_SERVER_*` variables. Training is
configured by recipe files (`configs/*.yaml`, sections described in
`trainer/config.py`) with dotted command-line overrides, not by the environment.
How the pieces run together: [deployment.md](deployment.md).

## Environment settings

The two that a multi-machine deployment must set on every service process:
`DATABASE_URL` (the store; default a SQLite file on this machine) and `REDIS_URL`
(the broker; default a Redis on this machine). Everything else has a working default.
"""


def render() -> str:
    lines = [HEADER, *render_settings(), *render_client(), "## Command-line flags", "",
             "Flags of the commands that run the services (each command's `--help` says the same).", ""]
    for prog, module_name, verbs in CLIS:
        lines += render_cli(prog, module_name, verbs)
    lines += ["## compose.yaml variables", "",
              "Read by `docker compose` from the shell or an `.env` file beside compose.yaml "
              "(see [deployment.md](deployment.md)).", "", *render_compose()]
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/configuration.md is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if DOC.exists() and DOC.read_text(encoding="utf-8") == text:
            return 0
        print(f"{DOC.relative_to(REPO)} is out of date: run .venv/bin/python scripts/gen_config_docs.py",
              file=sys.stderr)
        return 1
    DOC.write_text(text, encoding="utf-8")
    print(f"wrote {DOC.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
