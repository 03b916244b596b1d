"""`ferrox serve --help[=TOPIC]`: the settings' help in groups, as vLLM's `--help=<group>`.

`serve` and `run-batch` take every setting of `api/settings.py`'s table (90-odd flags), so
one flat `--help` is hundreds of lines. Each setting names its group there (the table's
`group` column); `GROUPS` below describes them, in the order the pages list them.

- `--help` (or `-h`): usage, the few flags a first start needs (`ESSENTIAL`, plus the
  command's own flags, such as run-batch's `-i` / `-o`) and the list of groups;
- `--help=all`: every flag, group by group;
- `--help=GROUP`: that group's flags, e.g. `--help=cache`;
- `--help=WORD`: every flag whose name contains WORD (`--help=timeout`);
  a word that matches nothing exits 2 naming the groups.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

# name -> what its flags set, in the order the pages list them.
GROUPS: dict[str, str] = {
    "model": "the checkpoint, its weights and kernels",
    "cache": "the KV cache: its budget, blocks and context ceiling",
    "scheduler": "continuous batching: rows, prompt chunks, the queue, the engine's fault limits",
    "parallel": "devices, the mesh and multi-host groups",
    "speculative": "speculative decoding (n-gram or a draft model)",
    "lora": "LoRA adapters",
    "server": "address, API key, TLS, CORS, shutdown, logs and the web pages",
    "limits": "what one request, connection or client may ask",
    "output": "a default output constraint for requests that give none",
    "sessions": "chat sessions, resumable streams and the response cache",
}
OTHER = "other"  # a setting whose group is not in GROUPS (the table's test names it)
# The settings a first start is most likely to need, listed by plain --help (run-batch
# listens on nothing: no address or key).
ESSENTIAL = ("model", "host", "port", "api_key", "kv_memory_gib", "max_seqs", "max_context", "log_level")
ESSENTIAL_OFFLINE = ("model", "kv_memory_gib", "max_seqs", "max_context", "log_level")
_ARGPARSE_GROUPS = ("positional arguments", "options", "optional arguments")  # argparse's own (-h lives there)


def group_of(name: str) -> str:
    return name if name in GROUPS else OTHER


def add_groups(parser: argparse.ArgumentParser, essential: Sequence[str] = ESSENTIAL) -> dict[str, Any]:
    """The grouped -h / --help, and an argument group per entry of `GROUPS` (and `OTHER`).
    Groups the command adds itself (run-batch's files) are its own flags: the first page
    lists them whole, then the `essential` settings."""
    parser.add_argument("-h", "--help", action=GroupedHelp, essential=tuple(essential))
    groups = {name: parser.add_argument_group(name, description) for name, description in GROUPS.items()}
    groups[OTHER] = parser.add_argument_group(OTHER, "settings not filed under a group")
    return groups


class GroupedHelp(argparse.Action):
    """-h / --help[=TOPIC]: prints the page for TOPIC (module docstring) and exits 0."""

    def __init__(self, option_strings: Sequence[str], dest: str, essential: tuple[str, ...] = ESSENTIAL,
                 **kwargs: Any) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs="?", const="",
                         metavar="TOPIC", help="this page; --help=all every flag, --help=GROUP one group "
                                               "(listed below), --help=WORD the flags whose name contains WORD")
        self.essential = essential

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option_string: Any = None) -> None:
        sys.stdout.write(help_page(parser, values or "", self.essential))
        parser.exit()


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's help with its default, except an unset one (None, False): "(default: None)"
    on half the flags says nothing; and a secret's (an API key from FERROX_API_KEY would be
    printed to whoever reads the terminal or the log the help went to): "(set)" instead."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False:
            return action.help or ""
        if getattr(action, "is_secret", False):
            return f"{action.help or ''} (set)"
        return super()._get_help_string(action)


def help_page(parser: argparse.ArgumentParser, topic: str, essential: Sequence[str] = ESSENTIAL) -> str:
    """The text `--help=topic` prints (`""`: the first page)."""
    settings = {g.title: g for g in parser._action_groups if g.title in GROUPS or g.title == OTHER}
    own = [g for g in parser._action_groups if g.title not in settings and g.title not in _ARGPARSE_GROUPS]
    topic = topic.strip().lower()
    if topic == "all":
        return _page(parser, [_section(g) for g in [*own, *settings.values()] if g._group_actions])
    if topic in settings:
        return _page(parser, [_section(settings[topic])])
    listed = [name for name, g in settings.items() if g._group_actions]
    if topic:
        word = topic.lstrip("-").replace("_", "-")
        found = [a for g in [*own, *settings.values()] for a in g._group_actions
                 if any(word in option for option in a.option_strings)]
        if not found:
            parser.error(f"--help={topic}: no group or flag by that name; try --help=all or one of the groups: "
                         f"{', '.join(listed)}")
        return _page(parser, [(f"flags matching {word!r}", None, found)])
    first = [a for name in essential for g in settings.values() for a in g._group_actions if a.dest == name]
    sections = [_section(g) for g in own] + [("essential flags", "the few a first start is most likely to need",
                                              first)]
    total = sum(len(g._group_actions) for g in settings.values())
    index = "\n".join(f"  --help={name:<12} {settings[name].description} ({len(settings[name]._group_actions)})"
                      for name in listed)
    return _page(parser, sections, epilog=f"{total} settings in {len(listed)} groups; --help=all lists every one, "
                                          f"--help=GROUP one group:\n{index}")


def _section(group: Any) -> tuple[str, str | None, list]:
    return group.title, group.description, group._group_actions


def _page(parser: argparse.ArgumentParser, sections: list[tuple[str, str | None, list]], epilog: str = "") -> str:
    # argparse's own format_help, over the chosen sections only.
    formatter = parser._get_formatter()
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    formatter.add_text(parser.description)
    for title, description, actions in sections:
        formatter.start_section(title)
        formatter.add_text(description)
        formatter.add_arguments(actions)
        formatter.end_section()
    page = formatter.format_help()
    return page + ("\n" + epilog + "\n" if epilog else "")
