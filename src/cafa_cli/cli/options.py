"""Command-line options generated from the settings objects (jobs/config.py), and help
that groups them into panels. A field's name, type, default and help are its option's:
the two cannot drift apart."""

from __future__ import annotations

import functools
import inspect
import re
import sys
import typing
from dataclasses import MISSING, fields
from typing import Annotated, Optional

import typer
from typer.core import TyperCommand, TyperOption

from cafa_cli.cli.completion import complete_method, complete_methods, complete_recipe
from cafa_cli.cli.errors import as_flags
from cafa_cli.cli.renamed import respelled
from cafa_cli.core.errors import UsageError, printable
from cafa_cli.engine.options import Norm
from cafa_cli.jobs.config.settings import PANELS, RecipeOptions
from cafa_cli.methods.recipes import SETTINGS as RECIPE_SETTINGS

COMPLETIONS = {"method": complete_method, "methods": complete_methods, "recipe": complete_recipe}  # by setting
OTHER = "Other options"


SHORT_HELP = "-h"
BRIEF = "cafa.brief"  # in ctx.meta: -h asked for the short help


class PanelledCommand(TyperCommand):
    """Plain click help (rich's boxes cut option names short at 80 columns), with the
    options grouped under the panel their settings name; old spellings of renamed options
    (renamed.py) still taken, and an option typed twice taken last, each with a warning.

    As git and ripgrep do, `-h` is the short help (what a user decides first: the options
    the command declares itself and the settings marked `brief`, each with its help's first
    sentence) and `--help` the whole; the short one ends saying so."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        args = respelled(ctx.command_path.partition(" ")[2], args)
        # -h and --help are one option to click, whose callback cannot tell them apart
        ctx.meta[BRIEF] = SHORT_HELP in args and "--help" not in args
        rest = super().parse_args(ctx, list(args))
        _warn_given_twice(self.make_parser(ctx).parse_args(list(args)))
        return rest

    def get_help_option(self, ctx):
        option = super().get_help_option(ctx)
        if option is not None:
            option.help = "Show the options decided first (-h) or all (--help)."
        return option

    def format_options(self, ctx, formatter) -> None:
        for title, rows in help_sections(self, ctx, brief=ctx.meta.get(BRIEF, False)):
            with formatter.section(title):
                formatter.write_dl(rows)

    def format_epilog(self, ctx, formatter) -> None:
        super().format_epilog(ctx, formatter)
        options = [p for p in self.params if p.param_type_name == "option"]
        shown = sum(p.name in (brief_parameters(self) or {p.name}) for p in options)
        if ctx.meta.get(BRIEF) and shown < len(options):
            with formatter.indentation():  # under the epilog's guide
                formatter.write_text(f"{shown} of {len(options)} options shown; all: {ctx.command_path} --help")
                formatter.write_text(f"Reference: {reference_page(ctx)}")


def reference_page(ctx) -> str:
    """The page of the docs' CLI reference that lists every option of the command (a subcommand
    is on its group's page)."""
    command = ctx.command_path.split()[1:2]
    return f"docs/reference/cli/{command[0] if command else 'index'}.md"


def brief_parameters(command) -> frozenset[str] | None:
    """The parameters the short help shows (with_settings names them), or None: all of them."""
    return getattr(command.callback, "brief_parameters", None)


def help_sections(command, ctx, brief: bool = False) -> list[tuple[str, list]]:
    """The command's help as (title, [(names and metavar, help)]) sections: its arguments, then
    its options by panel in PANELS' order. `brief`: those of the short help, each help cut
    to its first sentence (a default in brackets kept). --help and the CLI reference show these."""
    shown = brief_parameters(command) if brief else None
    arguments, panels = [], {}
    for param in command.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is None or (shown is not None and param.name not in shown):
            continue
        names, help = record
        if brief:
            help = first_sentence(help)
        if param.param_type_name == "argument":
            # typer writes an argument's Python type beside it (DOMAIN <list[str]>): its name says enough
            arguments.append((param.display_name_raw + ("..." if param.nargs != 1 else ""), help))
        else:
            panels.setdefault(getattr(param, "rich_help_panel", None) or OTHER, []).append((names, help))
    order = [*PANELS, *sorted(set(panels) - set(PANELS) - {OTHER}), OTHER]
    return [("Arguments", arguments)] * bool(arguments) + [(panel, panels[panel]) for panel in order if panel in panels]


def split_extra(help: str) -> tuple[str, str]:
    """An option's help and the bracket click and typer append ("[default: 200]", "[required]")."""
    if help.startswith("[") and help.endswith("]"):
        return "", help
    text, sep, extra = help.rpartition("  [")
    return (text, sep.strip() + extra) if sep and help.endswith("]") else (help, "")


def first_sentence(help: str) -> str:
    """The help up to its first full stop before a capital, with its bracket."""
    text, extra = split_extra(help)
    match = re.match(r".*?(?<!e\.g|i\.e)\.(?= [A-Z(])", text)
    return "  ".join(part for part in ((match.group() if match else text), extra) if part)


def option_parameters(config_type, skip: tuple[str, ...] = ()) -> list[inspect.Parameter]:
    """One keyword parameter per field of `config_type`, annotated for typer: the command's
    own fields first (its data, its method), then the groups it is made of, so that each
    help panel opens with what the command is about."""
    hints = typing.get_type_hints(config_type)
    own = set(vars(config_type).get("__annotations__", {}))
    parameters = []
    for f in sorted(fields(config_type), key=lambda f: f.name not in own):
        if f.name in skip or not f.metadata.get("option", True):
            continue
        meta = f.metadata
        names = meta["flags"] or (f"--{f.name.replace('_', '-')}",)
        hint = str if hints[f.name] is Norm else hints[f.name]  # typed as its text, which the settings parse
        if f.default is not MISSING:
            default = f.default
        elif f.default_factory is not MISSING:  # a list: repeated on the command line
            default, hint = None, Optional[hint]
        else:
            default = ...  # required
        help, show_default = meta["help"], meta["show_default"]
        if show_default and f.name in RECIPE_SETTINGS and issubclass(config_type, RecipeOptions):
            # `recipe` auto replaces it for most methods: the plain default would mislead
            help, show_default = f"{help}  [default: the recipe's, else {shown_default(default)}]", False
        option = typer.Option(
            *names,
            help=as_flags(help),  # the settings' words name each other as `reset`; the command line says --reset
            metavar=meta["metavar"],
            rich_help_panel=meta["panel"],
            show_default=show_default,
            autocompletion=COMPLETIONS.get(f.name),
        )
        parameters.append(
            inspect.Parameter(
                f.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=Annotated[hint, option]
            )
        )
    return parameters


def shown_default(value) -> str:
    """A default as --help writes it: 0.001, not 1e-03."""
    return f"{value:g}" if isinstance(value, float) else str(value)


def with_settings(config_type, skip: tuple[str, ...] = ()):
    """Give a command `def cmd(ctx, ..., **settings)` one option per setting of
    `config_type`; it receives them as keyword arguments, ready for `config_type(**settings)`."""

    def decorate(command):
        own = [p for p in inspect.signature(command, eval_str=True).parameters.values() if p.kind is not p.VAR_KEYWORD]
        generated = option_parameters(config_type, skip + tuple(p.name for p in own))

        @functools.wraps(command)
        def wrapper(**kwargs):
            return command(**kwargs)

        wrapper.__signature__ = inspect.Signature([*own, *generated])
        wrapper.__annotations__ = {p.name: p.annotation for p in [*own, *generated]}
        # the short help's: what the command declares itself (its data, --quiet), and the settings marked brief
        brief = {f.name for f in fields(config_type) if f.metadata.get("brief")}
        wrapper.brief_parameters = frozenset(p.name for p in [*own, *generated] if p in own or p.name in brief)
        return wrapper

    return decorate


def _warn_given_twice(parsed: tuple) -> None:
    """An option that takes one value, typed more than once: the last is taken, as shells and
    wrappers expect (`cafa adapt $COMMON --lr 0.01`), and said on stderr, since `--source Art
    --source Clipart` ran on Clipart alone without a word. A plain flag twice says one thing twice."""
    values, _, order = parsed
    counts: dict[str, int] = {}
    for param in order:
        single = isinstance(param, TyperOption) and not param.multiple and not param.count
        if single and (not param.is_flag or param.secondary_opts):
            counts[param.name] = counts.get(param.name, 0) + 1
    for param in dict.fromkeys(p for p in order if counts.get(p.name, 0) > 1):
        shown = "/".join(param.opts + param.secondary_opts)
        value = values.get(param.name)
        taken = ("on" if value else "off") if param.is_flag else printable(str(value))
        print(f"warning: {shown} is given {counts[param.name]} times; the last is taken ({taken})", file=sys.stderr)


def domains_given(ctx: typer.Context, domains: list[str] | None, data: list[str] | None, from_config) -> list[str]:
    """The DOMAIN arguments and --data values. Those typed on the command line replace
    what cafa.toml gives (under either name), as any option typed replaces the file's."""
    typed = [
        path
        for name, paths in (("data", data), ("domains", domains))
        if not from_config(ctx, name)
        for path in paths or []
    ]
    given = typed or [*(data or []), *(domains or [])]
    if not given:
        raise UsageError(f"give the test domains: {ctx.command_path} DOMAIN... (or --data DOMAIN, repeated)")
    return given


def chosen_settings(ctx: typer.Context, settings: dict) -> tuple[str, ...]:
    """The settings the user chose, on the command line or in cafa.toml (any value that is
    not the option's default): a recipe leaves them as they are."""
    sources = {name: ctx.get_parameter_source(name) for name in settings}
    return tuple(sorted(name for name, source in sources.items() if source is not None and source.name != "DEFAULT"))
