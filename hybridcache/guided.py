"""Structured output: a constraint on what a completion may be (JSON, a JSON schema, a regex, a grammar, a
choice or a Qwen-format tool call), enforced token by token with xgrammar, or with llguidance for a JSON schema
that xgrammar would read without enforcing (`schema_checks.unenforced_keyword`: `HttpUrl`'s `format: uri` with
`minLength`, `constr(min_length=..., pattern=...)`, `confloat(multiple_of=0.5)`...), as vLLM's `auto` backend falls
back from xgrammar to guidance. What llguidance refuses too (`uniqueItems`: pydantic's `set[...]`; a `format` it
does not know: `uuid4`, `binary`, `password`, `ipvanyaddress`) is refused, as vLLM refuses it.

    spec -- unenforced_keyword: None ---> xgrammar (`_grammar`)
         -- unenforced_keyword: "..." --> llguidance (`LLGuidanceCompiler`), or a ValueError naming both

`GuidedSpec` is what a request asks for (hashable, it rides in `SamplingParams.guided`). `GrammarCache` turns
specs into matchers for one tokenizer (both libraries' behind one interface: `accept_token`,
`fill_next_token_bitmask`, `rollback`, `is_terminated`); each completion of a request (n > 1) gets its own
matcher, so the grammar state forks: every completion advances only by its own tokens. The sampler applies
`fill_bitmask`'s allowed-token bitmask; the engine calls `accept` with each sampled token.

xgrammar and llguidance are imported when a constrained request needs them, or by `GrammarCache.prepare`, which
the server runs at start-up on a thread of its own (the `guided` extra; a library that does not import is skipped).
"""

from __future__ import annotations

import contextlib
import enum
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from hybridcache.guided_kimi import section_rules as kimi_section_rules
from hybridcache.guided_llguidance import LIST_TAGS, LLGuidanceCompiler, LLGuidanceGrammar, LLGuidanceMissing
from hybridcache.guided_python import PYTHON_FORMATS, arguments_of, python_rules, python_values
from hybridcache.schema_checks import unenforced_keyword


class GuidedKind(enum.Enum):
    JSON_OBJECT = "json_object"  # any JSON object
    JSON_SCHEMA = "json_schema"  # `spec`: the schema as JSON text
    REGEX = "regex"
    GRAMMAR = "grammar"  # EBNF (GBNF) text, or Lark text (no `::=` rule: `is_lark`)
    CHOICE = "choice"  # `spec`: a JSON list of strings, the completion is one of them
    TOOL_CALLS = "tool_calls"  # `spec`: a JSON list of tool schemas; calls in `tool_format` (one unless `parallel`)


# How a forced tool call is written (`GuidedSpec.tool_format`), each call `{"name": N, "arguments": A}`:
#   "qwen"      Qwen3's blocks, a newline between two:  <tool_call>\n{call}\n</tool_call>
#   "nemotron"  NVIDIA's one list (Nemotron-Nano-9B-v2, `--tool-call-parser nemotron_json`):
#               <TOOLCALL>[{call}, {call}]</TOOLCALL>
#   "jamba"     AI21's one list (Jamba 1.5 to 1.7, `--tool-call-parser jamba`):
#               <tool_calls>[{call}, {call}]</tool_calls>
#   "kimi"      Moonshot's section (Kimi Linear, `--tool-call-parser kimi_k2`), the arguments A alone, the call's id
#               naming the function and counting the calls (`guided_kimi`): <|tool_calls_section_begin|>
#               <|tool_call_begin|>functions.N:0<|tool_call_argument_begin|>A<|tool_call_end|> ...
#               <|tool_calls_section_end|>
#   "lfm2", "olmo3", "pythonic"  Python calls, `N(key=value, ...)` with the arguments A as keywords, values as Python
#               literals (`guided_python`): <|tool_call_start|>[N(a=1), ...]<|tool_call_end|> (LFM2),
#               <function_calls>N(a=1)\n...</function_calls> (OLMo 3), [N(a=1), ...] (the whole reply)
TOOL_FORMATS = ("qwen", *LIST_TAGS, "kimi", *PYTHON_FORMATS)

# Behind a marker (`GuidedSpec.starts_after`: a reasoning model's `</think>`) a forced call or a JSON answer may follow
# up to this many spaces or newlines: chat templates and trained models write a blank line there
# ("</think>\n\n<tool_call>", "</think>\n\n{"), and a grammar that refused it would push the model off what it
# learned. Bounded, so it cannot stall in whitespace. (A regex, choice or grammar answer starts at the next token:
# its text must match as it is.)
LEAD_SPACE = 4
LEAD_KINDS = frozenset({GuidedKind.TOOL_CALLS, GuidedKind.JSON_OBJECT, GuidedKind.JSON_SCHEMA})


@dataclass(frozen=True)
class GuidedSpec:
    """A constraint: `kind` and its `spec` text. `starts_after`: the constraint applies from the token after the
    one with which the completion's text first contains this marker, and the completion is free until then (a
    reasoning model's `</think>`: the answer is constrained, its reasoning is not, as vLLM does with a reasoning
    parser); "" = from the first token. TOOL_CALLS and JSON behind a marker may start with up to `LEAD_SPACE`
    spaces or newlines (`lead_space`). `parallel` (TOOL_CALLS only): one or more calls rather than exactly one;
    `tool_format` (TOOL_CALLS only): how the calls are written, one of `TOOL_FORMATS` (the model's own format, which
    the server's tool-call parser reads)."""

    kind: GuidedKind
    spec: str = ""
    starts_after: str = ""
    parallel: bool = False
    tool_format: str = "qwen"

    def __post_init__(self) -> None:
        if self.tool_format not in TOOL_FORMATS:
            raise ValueError(f"unknown tool-call format {self.tool_format!r}; known: {', '.join(TOOL_FORMATS)}")

    @property
    def lead_space(self) -> int:
        """How many spaces or newlines the constraint takes before its text: `LEAD_SPACE` for tool calls and JSON
        behind a marker (`LEAD_KINDS`), else none."""
        return LEAD_SPACE if self.kind in LEAD_KINDS and self.starts_after else 0

    @classmethod
    def json_schema(cls, schema: dict[str, Any]) -> GuidedSpec:
        """The schema's keys keep their order: a schema's `properties` order is the order the output writes them
        in (xgrammar's, OpenAI's and vLLM's rule), so two schemas that differ only in key order differ."""
        return cls(GuidedKind.JSON_SCHEMA, json.dumps(schema))

    @classmethod
    def tool_calls(cls, tools: Sequence[dict[str, Any]], parallel: bool = False,
                   tool_format: str = "qwen") -> GuidedSpec:
        """One call `{"name": N, "arguments": A}` with N one of `tools`' names and A valid for that tool's
        `parameters` schema (arguments in its order), written in `tool_format` (`TOOL_FORMATS`); `parallel`: one or
        more calls."""
        return cls(GuidedKind.TOOL_CALLS, json.dumps(list(tools)), parallel=parallel, tool_format=tool_format)


class GuidedUnavailable(ValueError):
    """Structured output needs the xgrammar package (a ValueError: the request asks for what is missing)."""


def _xgrammar():
    try:
        import xgrammar
    except ImportError as error:
        if error.name == "xgrammar":
            raise GuidedUnavailable("structured output needs the xgrammar package (pip install "
                                    "'hybridcache-llm[guided]')") from error
        raise GuidedUnavailable(f"structured output needs xgrammar, which is installed but fails to import: "
                                f"{error}") from error
    return xgrammar


_TOJSON_SEPARATORS = (", ", ": ")  # how Jinja's tojson (and json.dumps) writes JSON: what chat templates render


class GrammarCache:
    """Compiles specs for one tokenizer and makes matchers. Compiled grammars are kept by spec, the least recently
    used dropped once they pass `limit_bytes` together (vLLM keeps xgrammar's compiler cache at 512 MiB: a JSON
    schema over a 150k vocabulary compiles to ~190 KB, and a server sees a new schema with every request of some
    clients); the one just compiled is kept whatever its size.

    Thread-safe: the server compiles a request's spec (`check`, seconds for a large schema) on a worker thread
    while the engine thread steps on, and the engine thread's `matcher` then finds it compiled. A lock guards the
    kept grammars and their byte count; compiling runs outside it (two threads that compile the same spec at once
    both compile it, and the first kept is used)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 limit_bytes: int = 512 << 20) -> None:
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._compiler = None
        self._fallback = LLGuidanceCompiler(hf_tokenizer, vocab_size, stop_token_ids)
        # xgrammar's CompiledGrammar or an LLGuidanceGrammar, the least recently used first
        self._compiled: OrderedDict[GuidedSpec, Any] = OrderedDict()
        self._limit_bytes = limit_bytes
        self.num_bytes = 0  # the compiled grammars kept
        self._lock = threading.Lock()  # guards `_compiled` and `num_bytes`
        self._compiler_lock = threading.Lock()  # guards the making of `_compiler` (never under `_lock`)

    def prepare(self) -> None:
        """Build now what compiling builds on first use, for each library that imports: xgrammar's tokenizer info
        and compiler, llguidance's import and tokenizer (seconds: the first request that compiles a grammar would
        wait for them). A compile that needs one while it is being built waits for that build (each is made under
        a lock of its own), so the server runs this at start-up on a thread of its own (`app.build_app`)."""
        with contextlib.suppress(GuidedUnavailable):
            self._tokenizer_compiler(_xgrammar())
        with contextlib.suppress(LLGuidanceMissing):
            self._fallback.prepare()

    def check(self, spec: GuidedSpec) -> None:
        """Compile `spec` now (and keep it); raises ValueError (bad schema, regex or grammar, or a schema keyword
        neither xgrammar nor llguidance would enforce) or GuidedUnavailable."""
        self._compile(spec)

    def matcher(self, spec: GuidedSpec) -> Any:
        """A fresh matcher at the start of `spec`'s grammar; behind a `MarkerGate` when `spec.starts_after` is set.
        The gate decodes tokens with this cache's tokenizer (special tokens kept), several together where a
        character spans them."""
        compiled = self._compile(spec)
        matcher = (compiled.matcher() if isinstance(compiled, LLGuidanceGrammar) else
                   _xgrammar().GrammarMatcher(compiled))
        if not spec.starts_after:
            return matcher
        return MarkerGate(matcher, spec.starts_after, self._decode_ids)

    def _decode_ids(self, token_ids: list[int]) -> str:
        return self._hf_tokenizer.decode(token_ids, skip_special_tokens=False)

    def _compile(self, spec: GuidedSpec) -> Any:
        if not spec.lead_space:  # the grammar is the same whatever starts it (tool calls, JSON behind one: a lead)
            spec = replace(spec, starts_after="")
        with self._lock:
            compiled = self._compiled.get(spec)
            if compiled is not None:
                self._compiled.move_to_end(spec)
                return compiled
        compiled = self._compile_new(spec)
        with self._lock:
            if spec in self._compiled:  # another thread compiled it meanwhile
                self._compiled.move_to_end(spec)
                return self._compiled[spec]
            self._compiled[spec] = compiled
            self.num_bytes += compiled.memory_size_bytes
            while self.num_bytes > self._limit_bytes and len(self._compiled) > 1:
                _, dropped = self._compiled.popitem(last=False)
                self.num_bytes -= dropped.memory_size_bytes
        return compiled

    def _compile_new(self, spec: GuidedSpec) -> Any:
        """`spec` compiled (no lock held: this is the slow part): with llguidance where it holds a schema keyword
        xgrammar would not enforce (`_unenforced_in`), else with xgrammar."""
        unenforced = _unenforced_in(spec)
        if unenforced is not None:
            return self._compile_fallback(spec, unenforced)
        xgr = _xgrammar()
        compiler = self._tokenizer_compiler(xgr)
        try:
            compiled = compiler.compile_grammar(_grammar(xgr, spec))
        except Exception as error:  # noqa: BLE001 - xgrammar raises assorted types for a bad spec
            raise ValueError(f"invalid {spec.kind.value} constraint: {_clean_message(error)}") from None
        if not _can_start(xgr, compiled, self.vocab_size):
            raise ValueError(f"invalid {spec.kind.value} constraint: it allows no first token, so no output can "
                             "match it (a rule that only refers to itself, such as `x ::= x`, matches nothing)")
        return compiled

    def _compile_fallback(self, spec: GuidedSpec, unenforced: str) -> LLGuidanceGrammar:
        """`spec` (a JSON schema or tool calls) compiled with llguidance; a ValueError where llguidance is missing
        (naming the keyword xgrammar would not enforce) or refuses the schema (its reason first, as vLLM's guidance
        backend refuses it)."""
        prefix = f"invalid {spec.kind.value} constraint: {unenforced} is not supported"
        if spec.kind is GuidedKind.TOOL_CALLS and spec.tool_format in PYTHON_FORMATS:
            raise ValueError(f"{prefix} in a forced call of the Python-call format ({spec.tool_format}): xgrammar "
                             "would not enforce it, and llguidance writes values as JSON only (remove it, or use "
                             "tool_choice 'auto' and check the arguments yourself)")
        try:
            if spec.kind is GuidedKind.JSON_SCHEMA:
                compiled = self._fallback.json_schema(json.loads(spec.spec), spec.lead_space)
            elif spec.tool_format == "kimi":
                compiled = self._fallback.kimi_section([_function(tool) for tool in json.loads(spec.spec)],
                                                       spec.parallel, spec.lead_space)
            else:
                compiled = self._fallback.tool_calls([_call_schema(tool) for tool in json.loads(spec.spec)],
                                                     spec.parallel, spec.tool_format, spec.lead_space)
        except LLGuidanceMissing as error:
            raise ValueError(f"{prefix} by xgrammar (it would not enforce it), and {error}") from None
        except ValueError as error:  # (llguidance's reason first: it names what no backend here enforces)
            raise ValueError(f"invalid {spec.kind.value} constraint: llguidance refuses the schema ({error}), and "
                             f"{unenforced} is not supported by xgrammar (it would not enforce it): remove what "
                             "llguidance names, or check the output yourself") from None
        if not _llguidance_can_start(compiled, self.vocab_size):
            raise ValueError(f"invalid {spec.kind.value} constraint: it allows no first token, so no output can "
                             "match it")
        return compiled

    def _tokenizer_compiler(self, xgr: Any) -> Any:
        with self._compiler_lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self._hf_tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self._stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)  # (this class keeps what is compiled)
            return self._compiler

    def __len__(self) -> int:
        return len(self._compiled)


class MarkerGate:
    """A grammar matcher that stays closed (allows every token, accepts none) until the completion's text holds
    `marker`, then passes everything to `matcher`, from the next token on. The marker is looked for in the last
    tokens' texts, as many tokens as the marker has UTF-8 bytes (a token holds at least one), so a marker split over
    tokens is found wherever it starts; where a token alone decodes to a broken character (U+FFFD: part of a
    character past ASCII) those tokens are decoded together (`decode_ids`). The token that completes the marker is
    not fed to the grammar. The interface `fill_bitmask` and `OutputProcessor` use: `is_terminated`,
    `accept_token`, `fill_next_token_bitmask` (a closed gate leaves its row's bits all set), and `rollback` (as
    xgrammar's matcher: speculative decoding accepts drafts to fill their masks, then takes them back).

        marker "</think>" (8 bytes), tokens "ok", ".</", "th", "ink", ">"
        texts kept after ">": ["ok", ".</", "th", "ink", ">"] -> "ok.</think>" holds it: open

    The gate keeps the last tokens it took while closed (its id and text: what a rollback into them restores), as
    many as its window plus `MAX_ROLLBACK` (a rollback takes back at most a verify row's drafts), and the count of
    tokens it has fed the grammar since it opened."""

    MAX_ROLLBACK = 64  # more than any speculative decoding's drafts per row (num_speculative_tokens <= 8)

    def __init__(self, matcher: Any, marker: str, decode_ids: Callable[[list[int]], str]) -> None:
        self.matcher, self.marker, self._decode_ids = matcher, marker, decode_ids
        self._window_len = max(1, len(marker.encode()))
        self._seen: list[tuple[int, str]] = []  # (token, its text alone) of each token taken while closed
        self._num_fed = 0  # tokens the grammar has accepted since the gate opened
        self.open = False

    def is_terminated(self) -> bool:
        return self.open and self.matcher.is_terminated()

    def accept_token(self, token: int) -> bool:
        if self.open:
            accepted = self.matcher.accept_token(token)
            self._num_fed += bool(accepted)
            return accepted
        self._seen.append((token, self._decode_ids([token])))
        if len(self._seen) > 2 * (self._window_len + self.MAX_ROLLBACK):  # (trimmed in batches: amortised O(1))
            del self._seen[: len(self._seen) - self._window_len - self.MAX_ROLLBACK]
        recent = self._seen[-self._window_len:]
        text = "".join(piece for _, piece in recent)
        if "\ufffd" in text:  # (a character split over tokens: decode them together)
            text = self._decode_ids([token for token, _ in recent])
        self.open = self.marker in text
        return True

    def rollback(self, num_tokens: int) -> None:
        """Take back the last `num_tokens` accepted tokens: those the grammar accepted, then (closing the gate)
        those it took while closed, the one that opened it first."""
        fed = min(num_tokens, self._num_fed)
        closed = num_tokens - fed
        if closed > len(self._seen):
            raise ValueError(f"cannot roll back {num_tokens} tokens: the gate has taken {fed + len(self._seen)}")
        if fed:
            self.matcher.rollback(fed)
            self._num_fed -= fed
        if closed:
            del self._seen[len(self._seen) - closed:]
            self.open = False

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        if self.open:
            self.matcher.fill_next_token_bitmask(bitmask, index)


def _unenforced_in(spec: GuidedSpec) -> str | None:
    """The first keyword xgrammar would not enforce in a JSON-schema or tool-calls spec's schemas, or None."""
    if spec.kind is GuidedKind.JSON_SCHEMA:
        return unenforced_keyword(json.loads(spec.spec))
    if spec.kind is GuidedKind.TOOL_CALLS:
        return next((found for tool in json.loads(spec.spec) if (found := unenforced_keyword(_call_schema(tool)))),
                    None)
    return None


def _llguidance_can_start(compiled: LLGuidanceGrammar, vocab_size: int) -> bool:
    """`_can_start` for an llguidance grammar."""
    matcher = compiled.matcher()
    bitmask = _allocate_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return bool(bitmask.any())


def _allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """An allowed-token bitmask, every bit set: [num_rows, ceil(vocab_size / 32)] int32 (xgrammar's and
    llguidance's layout: token t is bit t % 32 of word t // 32)."""
    return torch.full((num_rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def _can_start(xgr: Any, compiled: Any, vocab_size: int) -> bool:
    """Whether a fresh matcher of `compiled` allows some token (or accepts the empty output): a grammar whose
    start allows nothing would leave every logit masked, and the sampler would emit token 0 forever."""
    matcher = xgr.GrammarMatcher(compiled)
    if matcher.is_terminated():
        return True
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return bool(bitmask.any())


_SOURCE_PREFIX = re.compile(r"^\s*(?:\[[\d:.]+\]\s*)?\S+\.(?:cc|cpp|h|hpp|py):\d+:\s*")


def _clean_message(error: Exception) -> str:
    """An xgrammar error without its log prefix (a time and a C++ source path): what is wrong with the spec."""
    lines = [_SOURCE_PREFIX.sub("", line).strip() for line in str(error).splitlines()]
    return " ".join(line for line in lines if line) or type(error).__name__


def _grammar(xgr: Any, spec: GuidedSpec) -> Any:
    """`spec`'s xgrammar grammar, after up to `spec.lead_space` spaces or newlines."""
    grammar = _body(xgr, spec)
    if not spec.lead_space:
        return grammar
    return xgr.Grammar.concat(xgr.Grammar.from_ebnf(f"root ::= [ \\n]{{0,{spec.lead_space}}}"), grammar)


def _body(xgr: Any, spec: GuidedSpec) -> Any:
    kind = spec.kind
    if kind is GuidedKind.JSON_OBJECT:
        return xgr.Grammar.from_json_schema({"type": "object"}, any_whitespace=False)
    if kind is GuidedKind.JSON_SCHEMA:
        return _json_schema(xgr, spec.spec)
    if kind is GuidedKind.REGEX:
        return xgr.Grammar.from_regex(spec.spec)
    if kind is GuidedKind.GRAMMAR:
        return xgr.Grammar.from_lark(spec.spec) if is_lark(spec.spec) else xgr.Grammar.from_ebnf(spec.spec)
    if kind is GuidedKind.CHOICE:
        choices = json.loads(spec.spec)
        return xgr.Grammar.union(*(_literal(xgr, choice) for choice in choices))
    return _tool_calls(xgr, spec)


def _tool_calls(xgr: Any, spec: GuidedSpec) -> Any:
    """A TOOL_CALLS spec's calls in its `tool_format` (`TOOL_FORMATS`), from their first character."""
    if spec.tool_format == "kimi":
        return _kimi_section(xgr, [_function(tool) for tool in json.loads(spec.spec)], spec.parallel)
    if spec.tool_format in PYTHON_FORMATS:
        return _python_calls(xgr, [_function(tool) for tool in json.loads(spec.spec)], spec.parallel,
                             spec.tool_format)
    calls = [_json_schema(xgr, _call_schema(tool)) for tool in json.loads(spec.spec)]
    call = calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls)
    if spec.tool_format in LIST_TAGS:
        opening, closing = LIST_TAGS[spec.tool_format]
        listed = _one_or_more(xgr, call, ", ") if spec.parallel else call
        return xgr.Grammar.concat(_literal(xgr, opening), listed, _literal(xgr, closing))
    block = xgr.Grammar.concat(_literal(xgr, "<tool_call>\n"), call, _literal(xgr, "\n</tool_call>"))
    return _one_or_more(xgr, block, "\n") if spec.parallel else block


def _one_or_more(xgr: Any, grammar: Any, separator: str) -> Any:
    """`grammar` one or more times, `separator` between two: `calls ::= root (separator root)*` over its rules."""
    text = str(grammar)
    names = {line.split("::=", 1)[0].strip() for line in text.splitlines() if "::=" in line}
    name = next(f"repeated{i}" for i in range(len(names) + 1) if f"repeated{i}" not in names)
    separator = json.dumps(separator, ensure_ascii=False)
    return xgr.Grammar.from_ebnf(f"{text}\n{name} ::= root ({separator} root)*\n", root_rule_name=name)


def _kimi_section(xgr: Any, functions: Sequence[tuple[str, dict[str, Any]]], parallel: bool) -> Any:
    """Kimi's section (`guided_kimi`) over the functions' (name, parameters): the parameters' grammars as the
    branches of one union (xgrammar renames their rules apart; its root rule names one branch a tool, in order),
    then the section's rules around them."""
    text = str(xgr.Grammar.union(*(_json_schema(xgr, parameters) for _, parameters in functions)))
    root = next(line for line in text.splitlines() if line.startswith("root ::="))
    branches = re.findall(r"\((\w+)\)", root)  # root ::= ((root_1) | (root_2) | ...)
    if len(branches) != len(functions):
        raise RuntimeError(f"xgrammar's union of {len(functions)} grammars has an unexpected root rule: {root}")
    names = {line.split("::=", 1)[0].strip() for line in text.splitlines() if "::=" in line}
    prefix = next(f"kimi{i}" for i in range(len(names) + 1) if not any(n.startswith(f"kimi{i}_") for n in names))
    section, rules = kimi_section_rules([name for name, _ in functions], branches, parallel, prefix=prefix,
                                               defines="::=")
    return xgr.Grammar.from_ebnf("\n".join([text, *rules, ""]), root_rule_name=section)


def _python_calls(xgr: Any, functions: Sequence[tuple[str, dict[str, Any]]], parallel: bool,
                  tool_format: str) -> Any:
    """Python calls (`guided_python`) of the functions' (name, parameters): every argument's JSON grammar a branch
    of one union (xgrammar renames their rules apart; its root rule names the branches in order), rewritten as
    Python literals, then the calls' rules around them."""
    tools = [(name, *arguments_of(name, parameters)) for name, parameters in functions]
    values = [_json_schema(xgr, schema) for _, arguments, _ in tools for _, schema in arguments]
    text, branches = "", []
    if values:
        text = python_values(str(xgr.Grammar.union(*values)))
        root = next(line for line in text.splitlines() if line.startswith("root ::="))
        branches = re.findall(r"\((\w+)\)", root)
        if len(branches) != len(values):
            raise RuntimeError(f"xgrammar's union of {len(values)} grammars has an unexpected root rule: {root}")
    names = {line.split("::=", 1)[0].strip() for line in text.splitlines() if "::=" in line}
    prefix = next(f"py{i}" for i in range(len(names) + 1) if not any(n.startswith(f"py{i}_") for n in names))
    rules, at = [], iter(branches)
    for name, arguments, required in tools:
        rules.append((name, [(key, next(at)) for key, _ in arguments], required))
    calls, lines = python_rules(rules, parallel, tool_format, prefix=prefix)
    return xgr.Grammar.from_ebnf("\n".join([text, *lines, ""]), root_rule_name=calls)


def _function(tool: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A tool's (name, parameters schema) (OpenAI's `{"type": "function", "function": {...}}`, or the function
    alone); parameters left out are any object, as in `tool_call_schema`."""
    function = tool.get("function", tool)
    return function["name"], dict(function.get("parameters") or {"type": "object"})


def _call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """`tool_call_schema` of a tool (OpenAI's `{"type": "function", "function": {...}}`, or the function alone)."""
    return tool_call_schema(*_function(tool))


_DEFINITIONS = ("$defs", "definitions")
_ARGUMENTS_POINTER = "#/properties/arguments"


def tool_call_schema(name: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
    """The JSON schema of one call, `{"name": <name>, "arguments": <parameters>}`. The parameters' definitions
    (`$defs`, `definitions`: what pydantic writes for nested, recursive and enum models) move to the root, where
    their `#/$defs/...` references point; any other local reference is rewritten to point into `arguments`."""
    parameters = dict(parameters or {"type": "object"})
    root: dict[str, Any] = {}
    for key in _DEFINITIONS:
        if key in parameters:
            root[key] = _rebase_refs(parameters.pop(key))
    root.update({
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": _rebase_refs(parameters)},
        "required": ["name", "arguments"],
    })
    return root


def _rebase_refs(node: Any) -> Any:
    """`node` with each local `$ref` that is not into the hoisted definitions rebased under `arguments`."""
    if isinstance(node, list):
        return [_rebase_refs(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _rebase_refs(value) for key, value in node.items()}
    ref = out.get("$ref")
    if isinstance(ref, str) and ref.startswith("#") and not any(ref.startswith(f"#/{d}/") for d in _DEFINITIONS):
        out["$ref"] = _ARGUMENTS_POINTER + ref[1:]
    return out


# xgrammar writes the characters of a length-bounded string as this class, which lets raw control characters
# through (invalid JSON); they must be escaped, as in its unbounded strings.
_LOOSE_CHARACTERS = r'[^\"\\\r\n]'
_STRICT_CHARACTERS = r'[^\0-\x1f\"\\]'


def _json_schema(xgr: Any, schema: str | dict[str, Any]) -> Any:
    """The schema's grammar, written the way `tojson` writes JSON, with no raw control characters in strings.
    Raises ValueError for a keyword xgrammar would read and not enforce (`unenforced_keyword`)."""
    unenforced = unenforced_keyword(json.loads(schema) if isinstance(schema, str) else schema)
    if unenforced is not None:
        raise ValueError(f"{unenforced} is not supported: xgrammar would not enforce it (remove it, or check the "
                         "output yourself)")
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, separators=_TOJSON_SEPARATORS)
    text = str(grammar)
    return xgr.Grammar.from_ebnf(text.replace(_LOOSE_CHARACTERS, _STRICT_CHARACTERS)) if _LOOSE_CHARACTERS in text \
        else grammar


def _literal(xgr: Any, text: str) -> Any:
    """A grammar matching exactly `text` (an EBNF string literal: JSON string escapes are EBNF's). Characters past
    ASCII are written as they are: EBNF reads each `\\uXXXX` escape as one code point, so a character outside the
    BMP escaped as a UTF-16 surrogate pair would become two lone surrogates (invalid UTF-8)."""
    return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text, ensure_ascii=False)}")


def is_lark(grammar: str) -> bool:
    """Whether a grammar's text is Lark rather than EBNF: it has no `::=` (vLLM's `grammar_is_likely_lark` rule).
    `start: "yes" | "no"` is Lark (its root rule is `start`); `root ::= "yes" | "no"` is EBNF."""
    return "::=" not in grammar


def fill_bitmask(matchers: Sequence[Any | None], vocab_size: int,
                 dead_end_tokens: Sequence[int] = ()) -> torch.Tensor | None:
    """The allowed-token bitmask [len(matchers), ceil(vocab/32)] int32 of these rows (every bit set where a
    row has no matcher), or None when no row is constrained. A row whose grammar allows no next token (a dead
    end, as after "a" in `root ::= "a" x`, `x ::= x`: no output can complete it) allows `dead_end_tokens`
    instead (the engine passes its EOS ids, so the choice ends rather than emit token 0 again and again)."""
    if all(m is None for m in matchers):
        return None
    bitmask = _allocate_bitmask(len(matchers), vocab_size)
    for i, matcher in enumerate(matchers):
        if matcher is not None and not matcher.is_terminated():
            matcher.fill_next_token_bitmask(bitmask, i)
            if dead_end_tokens and not bitmask[i].any():
                for token in dead_end_tokens:
                    bit = 1 << (token % 32)
                    bitmask[i, token // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit  # int32 words
    return bitmask
