"""vLLM's other spellings of a command line's flags, rewritten to this parser's before argparse reads them
(`vllm_argv`): vLLM's FlexibleArgumentParser takes `--max_model_len`, dotted JSON keys (`--speculative-config.method
mtp`), `--config FILE.yaml` and `-O` / `-cc` forms, and deployments copy those command lines. Used by cli.py for
every subcommand."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import NoReturn


def vllm_argv(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """`argv` (a `hybridcache SUBCOMMAND ...` command line without the program) as argparse takes it, with vLLM's
    other spellings (its FlexibleArgumentParser's) rewritten to this parser's, the one place that does so:

    - `--config FILE`: the YAML file's items (long flag names) go after the command line's, `key: value` as
      `--key value`, `true` as `--key`, `false` as `--no-key` (a flag with a --no- form; a plain switch is left
      off), a list as several values
      (`--key a b`, or `--key a --key b` for a repeatable flag), a dict as JSON text; a flag the command line also
      gives is taken from the command line alone (it wins; a MODEL first on the command line wins over the file's
      `model:`, as in vLLM).
    - `--max_model_len 4096`: `_` in a known flag's name (up to the first `.` or `=`) is `-`.
    - `--speculative-config.method mtp --speculative-config.num_speculative_tokens 1`: a flag's dotted keys
      (`--flag.key value` or `--flag.key=value`, the value JSON or else text) are folded into one JSON dict,
      `--speculative-config '{"method": "mtp", "num_speculative_tokens": 1}'`, put at the end (it wins over the
      flag's own JSON, as in vLLM).
    - `-O '{"level": 3}'`, `-O.key value`, `-cc ...`: vLLM's short names of `--compilation-config` (`-O3` / `-O 3`
      stay the optimisation level).

    Arguments after `--`, and flags this parser does not know, are left as they are (argparse then names them).
    A bad --config file or key is a ValueError naming both."""
    if not argv or argv[0] not in _subparsers(parser):
        return list(argv)
    sub = _subparsers(parser)[argv[0]]
    known = sub._option_string_actions
    args, rest = _split_at_double_dash(list(argv[1:]))
    args = _expand_config(sub, args)
    if "--compilation-config" in known:
        args = _compilation_config_short_forms(args)
    out: list[str] = []
    folded: dict[str, dict] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if not arg.startswith("--") or len(arg) < 3:
            _refuse_abbreviated(known, arg)
            out.append(arg)
            continue
        name, has_value, value = arg.partition("=")
        head, dotted, keys = name.partition(".")
        flag = "--" + head[2:].replace("_", "-")
        if flag not in known:
            out.append(arg)
        elif not dotted:
            out.append(flag + (f"={value}" if has_value else ""))
        elif not has_value and i == len(args):
            raise ValueError(f"{name}: expected a value")
        else:
            if not has_value:
                value, i = args[i], i + 1
            _merge(folded.setdefault(flag, {}), keys.split("."), _json_or_text(value))
    for flag, value in folded.items():
        out += [flag, json.dumps(value)]
    return [argv[0], *out, *rest]


def _refuse_abbreviated(known: dict[str, argparse.Action], arg: str) -> None:
    """A ValueError for a single-dash argument that only starts a flag's name (`-d` for `-dp`): argparse (3.11)
    matches such prefixes even with allow_abbrev=False, so `serve -d 2` ran data parallelism and each replica,
    given `-d 2` again, tried to run its own. A flag with its value attached (`-O3`, `-tp=2`) and a negative
    number are arguments as they are."""
    if not arg.startswith("-") or arg.startswith("--") or len(arg) < 2 or arg[1].isdigit() or arg[1] == ".":
        return
    name = arg.partition("=")[0]
    if name in known or arg[:2] in known:
        return
    meant = sorted(option for option in known if option.startswith(name) and not option.startswith("--"))
    if meant:
        raise ValueError(f"unrecognized argument {name}: flags are never abbreviated (did you mean "
                         f"{' or '.join(meant)}?)")


def _compilation_config_short_forms(args: list[str]) -> list[str]:
    """vLLM's short names of --compilation-config as the long one: `-cc X` / `-cc.key v`, `-O.key v` and `-O` with
    a JSON object (`-O '{"level": 3}'`, `-O{...}`); `-O3` and `-O 3` are left as the optimisation level."""
    out: list[str] = []
    for i, arg in enumerate(args):
        following = args[i + 1] if i + 1 < len(args) else ""
        if arg == "-cc" or arg.startswith(("-cc.", "-cc=")):
            out.append("--compilation-config" + arg[3:])
        elif arg.startswith("-O."):
            out.append("--compilation-config" + arg[2:])
        elif arg.startswith("-O{") or arg.startswith("-O={"):
            out += ["--compilation-config", arg[2:].removeprefix("=")]
        elif arg == "-O" and following.lstrip().startswith("{"):
            out.append("--compilation-config")
        else:
            out.append(arg)
    return out


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(action.choices for action in parser._actions if isinstance(action, argparse._SubParsersAction))


def _split_at_double_dash(args: list[str]) -> tuple[list[str], list[str]]:
    return (args[:args.index("--")], args[args.index("--"):]) if "--" in args else (args, [])


def _json_or_text(value: str) -> object:
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _merge(into: dict, keys: list[str], value: object) -> None:
    for key in keys[:-1]:
        into = into.setdefault(key, {})
    into[keys[-1]] = value


def _expand_config(sub: argparse.ArgumentParser, args: list[str]) -> list[str]:
    """`args` with `--config FILE` replaced by the file's items, after the rest (see `vllm_argv`)."""
    for i, arg in enumerate(args):
        if arg == "--config" or arg.startswith("--config="):
            if arg == "--config" and i + 1 == len(args):
                raise ValueError("--config: expected a YAML file")
            path = arg.partition("=")[2] if "=" in arg else args[i + 1]
            rest = args[:i] + args[i + (1 if "=" in arg else 2):]
            # after the command line (whose own flags were left out of them): a multi-value flag of the file put
            # before a positional MODEL took MODEL for one of its values (vLLM keeps the positional first too)
            given = _given_dests(sub, rest)
            if _has_positional(sub, rest):  # `serve MODEL --config f`: MODEL wins over the file's `model:`, as
                given.add("model")          # vLLM's model tag does, wherever it stands
            return [*rest, *_config_items(sub, path, given)]
    return args


def _has_positional(sub: argparse.ArgumentParser, args: list[str]) -> bool:
    """Whether `args` hold a positional argument: one that no flag before it takes as its value (each flag, in any
    of vLLM's spellings, takes what its `nargs` says; `--flag=value` and a short flag's attached value take none)."""
    known = sub._option_string_actions
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if not arg.startswith("-") or arg == "-":
            return True
        name = "--" + arg[2:].partition("=")[0].partition(".")[0].replace("_", "-") if arg.startswith("--") else arg
        action = known.get(name)
        if action is None or "=" in arg:
            continue  # (an unknown flag or one with its value attached: argparse names the problem later)
        if action.nargs in ("+", "*"):
            while i < len(args) and not args[i].startswith("-"):
                i += 1
        elif action.nargs == "?":
            i += 1 if i < len(args) and not args[i].startswith("-") else 0
        elif action.nargs != 0:
            i += action.nargs if isinstance(action.nargs, int) else 1
    return False


def _given_dests(sub: argparse.ArgumentParser, args: list[str]) -> set[str]:
    """The destinations of the flags in `args` (underscores or dots in their names included)."""
    known = sub._option_string_actions
    dests = set()
    for arg in args:
        if arg.startswith("--"):
            name = "--" + arg.partition("=")[0].partition(".")[0][2:].replace("_", "-")
        elif arg.startswith("-"):  # `-tp 2`, `-tp=2`, or a value attached to a short flag (`-O3`)
            name = arg.partition("=")[0] if arg.partition("=")[0] in known else arg[:2]
        else:
            continue
        if name in known:
            dests.add(known[name].dest)
    return dests


def _config_items(sub: argparse.ArgumentParser, path: str, given: set[str]) -> list[str]:
    """The command-line arguments of the YAML file at `path` (see `vllm_argv`), leaving out the flags whose
    destination is in `given` (the command line's own)."""
    import yaml

    try:
        with open(path, encoding="utf-8") as file:
            config = yaml.safe_load(file)
    except (OSError, yaml.YAMLError) as error:
        raise ValueError(f"--config {path}: cannot read it as YAML: {error}") from None
    if config is None:
        return []
    if not isinstance(config, dict):
        raise ValueError(f"--config {path}: expected a mapping of long flag names to values, got "
                         f"{type(config).__name__}")
    known = sub._option_string_actions
    items: list[str] = []
    for key, value in config.items():
        flag = "--" + str(key).removeprefix("--").replace("_", "-")
        action = known.get(flag)
        if action is None or flag == "--help":
            raise ValueError(f"--config {path}: unknown key {key!r} (no {flag} flag; keys are long flag names)")
        if action.dest in given:
            continue
        items += _config_item(path, key, flag, action, value)
    return items


def _config_item(path: str, key: object, flag: str, action: argparse.Action, value: object) -> list[str]:
    def refuse(why: str) -> NoReturn:
        raise ValueError(f"--config {path}: key {key!r}: {why}")

    if action.nargs == 0:  # a switch: store_true, or --flag / --no-flag
        if value is True:
            return [flag]
        if value is False:  # (a plain switch: left off, as vLLM's config files list switches as false)
            return ["--no-" + flag[2:]] if isinstance(action, argparse.BooleanOptionalAction) else []
        refuse(f"{flag} is a switch that takes true or false, got {value!r}")
    if value is None or isinstance(value, bool):
        refuse(f"{flag} takes a value, got {value!r}")
    if isinstance(value, list):
        texts = [_config_text(v) for v in value]
        if isinstance(action, argparse._AppendAction):
            return [part for text in texts for part in (flag, text)]
        if action.nargs in ("+", "*") and texts:
            return [flag, *texts]
        refuse(f"{flag} takes one value, got a list")
    return [flag, _config_text(value)]


def _config_text(value: object) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)
