"""MkDocs hook: the reference tables, generated at build time from the code, so they cannot drift.

- ``<!-- generated: options -->``: every plugin option from ``pytest_cudagraph.settings.OPTIONS`` (the one table
  the plugin builds its command-line flags, variables and ini keys from);
- ``<!-- generated: schema DEF -->``: the fields of ``$defs.DEF`` of ``pytest_cudagraph/report.schema.json``
  (``schema report`` for the report's top level), with their types and descriptions;
- ``<!-- repository only -->`` ... ``<!-- /repository only -->``: a note for readers of the Markdown file in the
  repository (where the markers render as nothing), left out of the site;
- ``CHANGELOG.md`` of the repository's root is added to the site as ``changelog.md``.

A marker this hook does not know fails the build, as does an option kind or a schema type it cannot render.
``pytest_cudagraph.settings`` is imported, not parsed: the plugin imports no torch until something uses it
(tests/test_layering.py), and the table then shows the very defaults and choices the plugin applies.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "pytest_cudagraph" / "report.schema.json"
MARKER = re.compile(r"^<!-- generated: (\w+)(?: (\w+))? -->$", re.M)
REPOSITORY_ONLY = re.compile(r"^<!-- repository only -->\n.*?^<!-- /repository only -->\n", re.M | re.S)

# what a value of each option kind is, in the words of the option's error messages
KINDS = {
    "bool": "on or off: `1`/`0`, `true`/`false`, `yes`/`no`, `on`/`off`",
    "int": "an integer ≥ 1",
    "float": "a number ≥ 0",
    "bytes": "a size: `64MiB` (KiB, MiB, GiB; KB, MB, GB are powers of 10)",
    "path": "a file path (its folder must exist and be writable)",
    "str": "",
}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _default(value: Any) -> str:
    from pytest_cudagraph.settings import shown_default

    shown = shown_default(value)
    return shown if value is None or isinstance(value, bool) else f"`{shown}`"


def options_table() -> str:
    for path in (ROOT / "src", ROOT):  # this checkout's plugin, whatever else is installed
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    from pytest_cudagraph.settings import OPTIONS

    rows = ["| command line | environment | ini | default | what it sets |", "|---|---|---|---|---|"]
    for o in OPTIONS:
        if o.kind not in KINDS:
            raise ValueError(f"docs/hooks/generate.py: option kind {o.kind!r} of --cudagraph-{o.name} has no "
                             "description in KINDS")
        if o.kind == "bool":
            flag = f"`--cudagraph-{o.name}`<br>`--no-cudagraph-{o.name}`"
        elif o.choices:
            flag = f"`--cudagraph-{o.name}={{{','.join(o.choices)}}}`"
        else:
            flag = f"`--cudagraph-{o.name}={o.name.upper()}`"
        value = KINDS[o.kind]
        what = o.help[0].upper() + o.help[1:] + "." + (f" Value: {value}." if value else "")
        rows.append(f"| {flag} | `{o.env}` | `{o.ini}` | {_default(o.default)} | {_cell(what)} |")
    return "\n".join(rows)


def _type(spec: dict[str, Any]) -> str:
    """A field's type in words: ``integer``, ``string or null``, ``array of [finding](#schema-finding)``."""
    ref = spec.get("$ref")
    if ref:
        name = ref.rsplit("/", 1)[-1]
        return f"[{name}](#schema-{name})"
    kinds = spec.get("type")
    if kinds is None:
        raise ValueError(f"docs/hooks/generate.py: a schema field without a type or $ref: {spec}")
    kinds = [kinds] if isinstance(kinds, str) else list(kinds)
    words = []
    for k in kinds:
        if k == "array" and "items" in spec and ("$ref" in spec["items"] or spec["items"].get("type") != "array"):
            words.append(f"array of {_type(spec['items'])}")
        else:
            words.append(k)
    return " or ".join(words)


def _described(schema: dict[str, Any], spec: dict[str, Any]) -> str:
    """A field that is only a ``$ref``: the description of what it refers to."""
    ref = spec.get("$ref", "")
    return schema["$defs"].get(ref.rsplit("/", 1)[-1], {}).get("description", "") if ref else ""


def schema_table(name: str) -> str:
    schema = json.loads(SCHEMA.read_text())
    node = schema if name == "report" else schema["$defs"].get(name)
    if node is None:
        raise ValueError(f"docs/hooks/generate.py: report.schema.json has no $defs.{name}")
    required = set(node.get("required", ()))
    rows = [node["description"], "", "| field | type | always there | description |", "|---|---|---|---|"]
    for field, spec in node["properties"].items():
        text = spec.get("description") or _described(schema, spec)
        if spec.get("enum") and not all(str(v) in text for v in spec["enum"]):
            text += " One of: " + ", ".join(f"`{v}`" for v in spec["enum"]) + "."
        if spec.get("deprecated"):
            text = "**Deprecated.** " + text
        rows.append(f"| `{field}` | {_cell(_type(spec))} | {'yes' if field in required else ''} | {_cell(text)} |")
    return "\n".join(rows)


def render(markdown: str, where: str = "a page") -> str:
    def one(m: re.Match) -> str:
        what, arg = m.group(1), m.group(2)
        if what == "options" and arg is None:
            return options_table()
        if what == "schema" and arg is not None:
            return schema_table(arg)
        raise ValueError(f"{where}: unknown marker {m.group(0)!r}: use <!-- generated: options --> or "
                         "<!-- generated: schema DEF -->")

    return MARKER.sub(one, REPOSITORY_ONLY.sub("", markdown))


# --- MkDocs events ---

def on_page_markdown(markdown: str, page, config, files) -> str:
    return render(markdown, page.file.src_uri)


def on_files(files, config):
    from mkdocs.structure.files import File

    changelog = ROOT / "CHANGELOG.md"
    files.append(File.generated(config, "changelog.md", content=changelog.read_text()))
    return files
