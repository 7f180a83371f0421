"""The `hybridcache` command line: generate (offline), serve (OpenAI-compatible HTTP), simulate (the cache
simulator) and bench (the engine benchmark). vLLM's other spellings of the flags (`--max_model_len`,
`--speculative-config.method mtp`, `--config FILE`) are rewritten before argparse reads them: `vllm_argv`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from importlib import import_module
from importlib.util import find_spec
from typing import NoReturn

from hybridcache.engine_args import HelpFormatter, add_engine_args, engine_options, model_argument, model_options
from hybridcache.extras import MissingExtra
from hybridcache.generation_config import add_generation_config_arg

# Subcommands that live with their feature: each module has `register(subparsers)`.
_SUBCOMMAND_MODULES = ("hybridcache.server.cli", "hybridcache.bench.cli", "hybridcache.router.cli")

DEFAULT_PROMPTS = (
    "The quick brown fox",
    "A hybrid model keeps a recurrent state that",
    "Prefix caching for hybrid models needs",
    "Once upon a time",
)


def cmd_generate(args: argparse.Namespace) -> int:
    from hybridcache import LLM

    model, hub = model_argument(args), model_options(args)
    if any(value is not None for value in hub.values()):  # LLM takes no revision: resolve the model folder here
        from hybridcache.model_path import resolve_model

        model = resolve_model(model, **hub).path
    # closed at the end: a disk tier (--disk-cache-dir) is handed what the cache holds, so a rerun hits it
    with LLM(model, generation_config=args.generation_config, **engine_options(args)) as llm:
        return _generate(llm, args)


def _generate(llm, args: argparse.Namespace) -> int:
    """Sample the command's prompts with `llm` and print one JSON line per completion, then a summary line."""
    from hybridcache import SamplingParams

    defaults = llm.sampling_defaults  # what a flag left unset takes, before the command's own defaults
    params = SamplingParams(
        temperature=defaults.pick("temperature", args.temperature, 0.0),
        top_p=defaults.pick("top_p", args.top_p, 1.0), top_k=defaults.pick("top_k", args.top_k, 0),
        min_p=defaults.pick("min_p", None, 0.0), repetition_penalty=defaults.pick("repetition_penalty", None, 1.0),
        max_tokens=defaults.pick("max_tokens", args.max_tokens, 32), n=args.n,
        ignore_eos=args.ignore_eos,
    )
    prompts = args.prompt or list(DEFAULT_PROMPTS)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for output in outputs:
        for completion in output.outputs:
            record = {
                "prompt": output.prompt, "completion": completion.index, "text": completion.text,
                "num_tokens": len(completion.token_ids), "finish_reason": completion.finish_reason,
                "cached_tokens": output.num_cached_tokens,
            }
            print(json.dumps(record, ensure_ascii=False))
    engine = llm.engine
    print(
        f"# {len(outputs)} prompts, {engine.num_prefill_tokens} prefill + {engine.num_decode_tokens} decode "
        f"tokens in {elapsed:.2f} s",
        file=sys.stderr,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridcache", description=__doc__, allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions for prompts (offline)", description=(
        "Generate completions for prompts with one engine, and print one JSON line per completion."),
        formatter_class=HelpFormatter, allow_abbrev=False)
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable; default: a few demo prompts)")
    from_file = "default: the model's generation_config.json (see --generation-config), else"
    gen.add_argument("--max-tokens", type=int, default=None,
                     help=f"new tokens per completion at most ({from_file} 32)")
    gen.add_argument("--temperature", type=float, default=None, help=f"0 is greedy ({from_file} 0)")
    gen.add_argument("--top-p", type=float, default=None, help=f"nucleus sampling, 1.0 is off ({from_file} 1.0)")
    gen.add_argument("--top-k", type=int, default=None, help=f"top-k sampling, 0 is off ({from_file} 0)")
    add_generation_config_arg(gen)
    gen.add_argument("-n", type=int, default=1, help="completions per prompt")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    gen.set_defaults(func=cmd_generate)
    for name in _SUBCOMMAND_MODULES:
        if find_spec(name.rsplit(".", 1)[0]) is not None and find_spec(name) is not None:
            import_module(name).register(sub)
    for command in sub.choices.values():  # read by `vllm_argv` before argparse: shown in --help only
        command.add_argument("--config", default=None, metavar="YAML",
                             help="a YAML file of long flag names and values, as vLLM's (`max-model-len: 4096`); "
                                  "the command line's flags win (default: none)")
    return parser


# ---- vLLM's command-line spellings ----------------------------------------------------------------------------


def vllm_argv(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """`argv` (a `hybridcache SUBCOMMAND ...` command line without the program) as argparse takes it, with vLLM's
    other spellings (its FlexibleArgumentParser's) rewritten to this parser's, the one place that does so:

    - `--config FILE`: the YAML file's items (long flag names) go after the command line's, `key: value` as
      `--key value`, `true` as `--key`, `false` as `--no-key` (a flag with a --no- form; a plain switch is left
      off), a list as several values
      (`--key a b`, or `--key a --key b` for a repeatable flag), a dict as JSON text; a flag the command line also
      gives is taken from the command line alone (it wins).
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
            return [*rest, *_config_items(sub, path, _given_dests(sub, rest))]
    return args


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


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The parsed command line (`sys.argv[1:]` by default) after `vllm_argv`; `args.argv` is the command line
    argparse took (`serve --data-parallel-size` gives it to its replicas)."""
    parser = build_parser()
    argv = vllm_argv(parser, sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except ValueError as error:  # a bad --config file
        print(f"hybridcache: error: {error}", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except (ValueError, OSError, MissingExtra) as error:  # bad input, missing files, an unreachable server
        print(f"hybridcache: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
