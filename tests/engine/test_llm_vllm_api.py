"""`LLM`'s offline API in the shapes vLLM users write against: chat messages with content parts and chat options,
`RequestOutput` / `CompletionOutput` fields, `get_tokenizer`, `SamplingParams(max_tokens=None)`."""

from __future__ import annotations

import typing
from dataclasses import replace

import pytest

from hybridcache import LLM, RequestOutputKind, SamplingParams
from hybridcache.detokenizer import token_text
from hybridcache.mm_processor import CHAT_ROLES, split_chat_images, template_content
from hybridcache.outputs import add_delta


@pytest.fixture(scope="module")
def llm():
    with LLM(max_model_len=512) as llm:
        yield llm


GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def test_text_parts_render_as_one_string_as_the_server_renders_them(llm):
    """`content: [{"type": "text", ...}, ...]` put the Python repr of the list into the prompt; offline chat now takes
    content through the server's own `template_content`, so both render the same prompt."""
    protocol = pytest.importorskip("hybridcache.server.protocol")
    parts = [{"role": "system", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
             {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    # the built-in template reads content as a string: vLLM joins text parts with "\n" for such a template
    plain = [{"role": "system", "content": "be \nbrief"}, {"role": "user", "content": "hi"}]
    [out] = llm.chat(parts, GREEDY, use_tqdm=False)
    assert out.prompt == llm.tokenizer.apply_chat_template(plain)
    assert "'type'" not in out.prompt
    body = protocol.parse_request(protocol.ChatCompletionRequest, {"messages": parts})
    served, _ = split_chat_images([m.as_template_input() for m in body.messages])
    assert llm.tokenizer.apply_chat_template(served) == out.prompt
    [none] = llm.chat([{"role": "user", "content": None}], GREEDY, use_tqdm=False)
    assert none.prompt == llm.tokenizer.apply_chat_template([{"role": "user", "content": ""}])


def test_template_content_joins_text_parts_and_keeps_image_parts():
    assert template_content(None) == template_content("") == template_content([]) == ""
    assert template_content([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]) == "ab"
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    assert template_content([{"type": "text", "text": "a"}, image]) == [{"type": "text", "text": "a"}, image]
    for bad in (5, [{"type": "audio"}], ["text"], [{"type": "text"}], [{"type": "text", "text": 3}]):
        with pytest.raises(ValueError):
            template_content(bad)


def test_a_message_without_a_known_role_is_a_value_error(llm):
    with pytest.raises(ValueError, match="message 0 has no 'role'"):
        llm.chat([{"content": "hi"}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="message 1 has role 'wizard'; a role is one of system, user"):
        llm.chat([{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="message 0: content part 0"):
        llm.chat([{"role": "user", "content": [{"type": "audio_url"}]}], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_the_chat_roles_are_the_servers():
    protocol = pytest.importorskip("hybridcache.server.protocol")
    assert typing.get_args(protocol.ChatMessage.model_fields["role"].annotation) == CHAT_ROLES


def test_chat_takes_vllms_template_options(llm):
    """`chat_template_kwargs`, `continue_final_message`, `tools` (and `add_generation_prompt`) as vLLM's `LLM.chat`
    takes them (a TypeError before), each reaching the template as `Tokenizer.apply_chat_template` passes it."""
    tok = llm.tokenizer
    user = [{"role": "user", "content": "hi"}]
    [no_think] = llm.chat(user, GREEDY, use_tqdm=False, chat_template_kwargs={"enable_thinking": False})
    assert no_think.prompt == tok.apply_chat_template(user, template_kwargs={"enable_thinking": False})
    assert no_think.prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    reply = [*user, {"role": "assistant", "content": "Hel"}]
    [continued] = llm.chat(reply, GREEDY, use_tqdm=False, continue_final_message=True, add_generation_prompt=False)
    assert continued.prompt.endswith("<|im_start|>assistant\nHel")
    [same] = llm.chat(reply, GREEDY, use_tqdm=False, continue_final_message=True)  # (the server's rule too)
    assert same.prompt == continued.prompt
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    [with_tools] = llm.chat(user, GREEDY, use_tqdm=False, tools=tools)
    assert with_tools.prompt == tok.apply_chat_template(user, tools=tools) and "get_weather" in with_tools.prompt
    [bare] = llm.chat(user, GREEDY, use_tqdm=False, add_generation_prompt=False)
    assert bare.prompt == tok.apply_chat_template(user, add_generation_prompt=False)
    with pytest.raises(ValueError, match="may not set 'tools'"):
        llm.chat(user, GREEDY, use_tqdm=False, chat_template_kwargs={"tools": []})


def test_chat_takes_a_chat_template_as_vllm(llm):
    """vLLM's `LLM.chat(chat_template=...)`: a Jinja template used instead of the folder's (a TypeError before),
    for every turn; the folder's template is left as it was."""
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    user = [{"role": "user", "content": "hi"}]
    [out] = llm.chat(user, GREEDY, use_tqdm=False, chat_template=template)
    assert out.prompt == "<user>hi</user><assistant>"
    assert llm.tokenizer.apply_chat_template(user).startswith("<|im_start|>user")
    [turn2] = llm.chat([*user, {"role": "assistant", "content": "ho"}, {"role": "user", "content": "again"}],
                       GREEDY, use_tqdm=False, chat_template=template)
    assert turn2.prompt == "<user>hi</user><assistant>ho</assistant><user>again</user><assistant>"


def test_outputs_carry_vllms_fields(llm):
    """`RequestOutput.num_cached_tokens`, `CompletionOutput.cumulative_logprob`, `stop_reason` and `logprobs` in
    vLLM's shape (a list of {token id: Logprob(logprob, rank, decoded_token)}); before, the first three were missing
    and logprobs were `TokenLogprob`s."""
    tok = llm.tokenizer
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True)
    first, again = llm.generate(["Hello there, friend", "Hello there, friend"], params, use_tqdm=False)
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0
    c = again.outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 4
    for i, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        assert next(iter(entry)) == token and len(entry) in (2, 3)
        assert entry[token].rank == 1  # greedy: the sampled token is the likeliest
        # its text as vLLM's (a token inside a character decoded after the sampled tokens before it)
        assert entry[token].decoded_token == token_text(lambda ids: tok.decode(ids, skip_special_tokens=False),
                                                        token, c.token_ids[max(0, i - 4):i])
        assert sorted(lp.rank for lp in entry.values()) == [1, 2] or len(entry) == 3
    assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))
    assert (c.finish_reason, c.stop_reason) == ("length", None)
    plain = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None
    assert llm.generate("Hello", SamplingParams(max_tokens=2, logprobs=0), use_tqdm=False)[0].outputs[0].logprobs[0]


def test_outputs_have_vllms_other_members(llm):
    """vLLM scripts filter on `CompletionOutput.finished()` and log `RequestOutput.metrics` (None unless stats are
    on): both raised AttributeError, as did the members for what this engine does not do."""
    out = llm.generate("Hello", GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].finished() is True
    assert (out.metrics, out.lora_request, out.encoder_prompt, out.encoder_prompt_token_ids,
            out.kv_transfer_params) == (None,) * 5


_DISK_SCRIPT = """
import pathlib, sys
from hybridcache import LLM, RequestOutputKind, SamplingParams
prompt = "The quick brown fox jumps over the lazy dog. " * 4


def bare_engine():
    from hybridcache.config import EngineConfig
    from hybridcache.engine.engine import LLMEngine

    engine = LLMEngine(None, EngineConfig(block_size=16, host_cache_gib=0.01, disk_cache_dir=sys.argv[1]))
    engine.add_request("first", prompt, SamplingParams(temperature=0, max_tokens=3))
    while not (done := [out for out in engine.step() if out.finished]):
        pass
    print("cached", done[0].num_cached_tokens)
    return engine


if sys.argv[2] == "bare-engine":  # an LLMEngine never closed, alive at exit
    engine = bare_engine()
    sys.exit(0)


def main():
    llm = LLM(block_size=16, host_cache_gib=0.01, disk_cache_dir=sys.argv[1])
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    print("cached", out.num_cached_tokens)
    return llm, out


if sys.argv[2] == "in-function":
    main()  # the LLM is dropped as main() returns: its cache is on disk before the script goes on
    assert any(pathlib.Path(sys.argv[1]).rglob("states/*.safetensors")), "nothing on disk after main() returned"
    sys.exit(0)
llm, out = main()
if sys.argv[2] == "keep-engine":
    engine = llm.engine
    del llm, out
    import gc
    gc.collect()
    engine.add_request("after", prompt)  # the wrapper is gone, its engine still works
    while engine.has_unfinished_requests():
        engine.step()
"""


ENDINGS = ("exit", "keep-engine", "in-function", "bare-engine")


@pytest.fixture(scope="module")
def disk_runs(tmp_path_factory) -> dict[str, list[tuple[int, str, str]]]:
    """`_DISK_SCRIPT` run twice for every ending, each ending on a disk folder of its own: the four endings' first
    runs side by side (separate processes, so they share nothing but the cores), then their second runs.
    {ending: [(return code, stdout, stderr) of the first run, of the second]}."""
    import os
    import subprocess
    import sys

    folder = tmp_path_factory.mktemp("never-closed")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs: dict[str, list[tuple[int, str, str]]] = {ending: [] for ending in ENDINGS}
    for ending in ENDINGS:
        (folder / ending).mkdir()  # (as each test's tmp_path was: the disk folder itself is the engine's to make)
    for turn in range(2):
        started = {}
        for ending in ENDINGS:
            out, err = (open(folder / f"{ending}-{turn}.{name}", "w+") for name in ("out", "err"))  # noqa: SIM115
            process = subprocess.Popen([sys.executable, "-c", _DISK_SCRIPT, str(folder / ending / "disk"), ending],
                                       stdout=out, stderr=err, text=True, env=env)
            started[ending] = process, out, err
        for ending, (process, out, err) in started.items():
            with out, err:
                returncode = process.wait(timeout=300)
                out.seek(0)
                err.seek(0)
                runs[ending].append((returncode, out.read(), err.read()))
    return runs


@pytest.mark.parametrize("ending", ENDINGS)
def test_an_llm_never_closed_hands_its_cache_to_the_disk_tier(disk_runs, ending):
    """vLLM's `LLM` has no close(): a script that just ends lost what the device pool and the host tier held, so
    every run of it missed. Its engine is now closed at exit; one whose `LLM` wrapper was dropped while its engine
    is kept (`LLM(...).engine`) keeps working until then; one made in a function (a script's `main()`) is closed
    as it is dropped (it was freed before exit, so the close at exit found nothing: hunt 184). A bare `LLMEngine`
    with a disk tier, never closed, exits cleanly and its cache is on disk: it was closed by `__del__` while the
    interpreter finalized, which aborted the process (rc 134, a PyTorch internal assertion; hunt 221)."""

    def cached_tokens(run: tuple[int, str, str]) -> int:
        returncode, stdout, stderr = run
        assert returncode == 0, stderr[-2000:]
        return int(stdout.split("cached ")[1].split()[0])

    first, second = disk_runs[ending]
    assert cached_tokens(first) == 0
    assert cached_tokens(second) > 0


def test_stop_reason_names_the_stop_string_or_stop_token(llm):
    tok = llm.tokenizer
    free = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = llm.generate("Hello", free, use_tqdm=False)[0].outputs[0]
    ids, third = out.token_ids, out.text[2:4]
    assert len(third) == 2
    by_string = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                     stop=["\u2603\u2603", third]), use_tqdm=False)[0].outputs[0]
    assert (by_string.finish_reason, by_string.stop_reason) == ("stop", third)
    by_token = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                    stop_token_ids=[ids[1]]), use_tqdm=False)[0].outputs[0]
    assert (by_token.finish_reason, by_token.stop_reason) == ("stop", ids[1])
    eos = tok.eos_token_id
    on_eos = llm.generate("Hello", SamplingParams(max_tokens=4, logit_bias={eos: 100}, stop_token_ids=[eos]),
                          use_tqdm=False)[0].outputs[0]
    assert (on_eos.finish_reason, on_eos.stop_reason) == ("stop", None)  # vLLM checks the EOS token first
    ignored = llm.generate("Hello", SamplingParams(max_tokens=4, logit_bias={eos: 100}, stop_token_ids=[eos],
                                                   ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert (ignored.finish_reason, ignored.stop_reason) == ("stop", eos)


def test_get_tokenizer_is_the_transformers_tokenizer(llm):
    """vLLM's `LLM.get_tokenizer()` (an AttributeError before) gives the transformers tokenizer vLLM users call
    `encode`, `decode` and `apply_chat_template(..., tokenize=False)` on."""
    from transformers import PreTrainedTokenizerBase

    tok = llm.get_tokenizer()
    assert isinstance(tok, PreTrainedTokenizerBase)
    assert tok.decode(tok.encode("Hello there", add_special_tokens=False)) == "Hello there"
    messages = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == llm.chat(messages, GREEDY, use_tqdm=False)[0].prompt
    assert tok.eos_token_id == llm.tokenizer.eos_token_id


def test_max_tokens_none_runs_up_to_the_model_length(llm):
    """vLLM's `SamplingParams(max_tokens=None)`: up to `max_model_len` (a ValueError before)."""
    params = SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)
    assert params.max_tokens is None and params.up_to(7).max_tokens == 7 and SamplingParams().up_to(7).max_tokens == 16
    prompt = [100 + i % 100 for i in range(500)]
    [out] = llm.generate(prompt, params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 512 - 500 and out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1 or None"):
        SamplingParams(max_tokens=0)


def test_chat_takes_tool_call_arguments_as_json_text_as_the_server_does(llm):
    """An agent's assistant turn sent back in OpenAI's shape carries `arguments` as JSON text (or "" for none):
    offline chat passed it to the template as it was (a template iterating over the arguments failed; the built-in
    one wrote `"arguments": }`), where the server (and vLLM's LLM.chat) parse it."""
    from hybridcache.server.protocol import ChatCompletionRequest, parse_request

    for arguments in ('{"city": "Paris"}', "", None):
        messages = [{"role": "user", "content": "weather?"},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
        [out] = llm.chat(messages, GREEDY, use_tqdm=False)
        served = parse_request(ChatCompletionRequest, {"messages": messages})
        rendered, _ = split_chat_images([m.as_template_input() for m in served.messages])
        assert out.prompt == llm.tokenizer.apply_chat_template(rendered), arguments
        assert '"arguments": }' not in out.prompt and ('"city": "Paris"' in out.prompt) == bool(arguments)
    [out] = llm.chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x", "tool_calls": []}],
                     GREEDY, use_tqdm=False)  # an empty list of calls is left out, as vLLM does


def test_vllms_optional_values_progress_callable_and_a_bad_params_entry(llm):
    """As vLLM's: `stop=None`, `stop_token_ids=None`, `logit_bias=None` are the empty defaults; LLM options of None
    are the engine's choice; `use_tqdm` may be a callable that builds the bar; `max_tokens=None` with a
    `min_tokens` beyond the room left runs to the model length ("length"; it raised); a params entry that is not a
    SamplingParams is a TypeError naming it (an AttributeError)."""
    from tqdm import tqdm

    from hybridcache.config import EngineConfig

    params = SamplingParams(stop=None, stop_token_ids=None, logit_bias=None)
    assert (params.stop, params.stop_token_ids, params.logit_bias) == ((), (), ())
    config = EngineConfig(max_num_seqs=None, max_num_batched_tokens=None, block_size=None)
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.block_size) == (16, 512, 64)
    bars = []

    def make_bar(*args, **kwargs):
        bars.append(kwargs)
        return tqdm(*args, **kwargs)

    llm.generate(["a", "b"], GREEDY, use_tqdm=make_bar)
    assert len(bars) == 1 and bars[0]["total"] == 2
    prompt = [100 + i % 100 for i in range(508)]
    [out] = llm.generate(prompt, SamplingParams(max_tokens=None, min_tokens=10, temperature=0), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 512 - 508 and out.outputs[0].finish_reason == "length"
    with pytest.raises(TypeError, match=r"sampling_params\[1\] must be a SamplingParams, got dict"):
        llm.generate(["a", "b"], [GREEDY, {"max_tokens": 1}], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_every_step_output_of_a_request_hands_out_its_prompt_ids_and_only_them(llm):
    """A streaming request's step outputs carry `prompt_token_ids` equal to its prompt at every step, with none of
    the tokens generated since, and all of them one list (`RequestState.prompt_token_ids`: made once, not a copy
    of the whole prompt per step), for each of n completions."""
    engine = llm.engine
    prompt = llm.tokenizer.encode("A prompt whose ids every streamed output repeats, word by word")
    engine.add_request("stream-ids", prompt, SamplingParams(temperature=0, max_tokens=5, n=2, ignore_eos=True))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [out for out in engine.step() if out.request_id == "stream-ids"]
    assert len(outputs) >= 5 and outputs[-1].finished
    assert all(out.prompt_token_ids == prompt for out in outputs)
    assert len({id(out.prompt_token_ids) for out in outputs}) == 1
    assert [len(c.token_ids) for c in outputs[-1].outputs] == [5, 5]
    engine.check_integrity()


def test_a_final_only_request_reports_its_progress_each_step_and_one_output_at_its_end(llm):
    """FINAL_ONLY requests build no output until they end; `step_progress` gives, after each step that gave them
    tokens, what their output would have said: each completion's output tokens so far, whether it ended, the
    prompt's and the cached tokens (the server times their tokens from it). Checked against the same request run
    streamed on the same cache state (cleared before each run)."""
    engine = llm.engine
    prompt = llm.tokenizer.encode("Progress without outputs, counted step by step for the latency metrics")
    params = SamplingParams(temperature=0, max_tokens=6, n=2, ignore_eos=True)
    runs = {}
    for final_only in (False, True):
        engine.clear_cache()
        kind = RequestOutputKind.FINAL_ONLY if final_only else RequestOutputKind.CUMULATIVE
        engine.add_request("r", prompt, replace(params, output_kind=kind))
        steps, outputs = [], []
        while engine.has_unfinished_requests():
            step_outputs = engine.step()
            outputs += step_outputs
            progress = engine.step_progress()
            assert not (final_only and progress and outputs), "progress after the final output"
            steps += [(len(out.prompt_token_ids), out.num_cached_tokens,
                       tuple(len(c.token_ids) for c in out.outputs),
                       tuple(c.finish_reason is not None for c in out.outputs)) for out in step_outputs]
            steps += [(p.num_prompt_tokens, p.num_cached_tokens, p.num_output_tokens, p.finished) for p in progress]
        runs[final_only] = steps
        assert len(outputs) == (1 if final_only else len(steps)) and outputs[-1].finished
        assert [len(c.token_ids) for c in outputs[-1].outputs] == [6, 6]
    assert runs[True] == runs[False]
    assert len(runs[True]) >= 6 and runs[True][0][0] == len(prompt)
    engine.check_integrity()


@pytest.mark.parametrize("stop", [(), ("e ", "\n\n")], ids=["no-stop", "stop-strings"])
def test_delta_outputs_add_up_to_the_cumulative_outputs_at_every_step(llm, stop):
    """DELTA outputs hold what is new; added up (`add_delta`) they equal, step by step, the CUMULATIVE outputs of
    the same request on the same cache state: texts (the byte-level model samples bytes that leave characters
    incomplete, and stop strings hold text back), token ids, logprobs, finish and stop reasons, the summed logprob.
    The prompt logprobs come in the first DELTA output only."""
    engine = llm.engine
    prompt = llm.tokenizer.encode("Deltas add up: caf\u00e9 \u20ac \U0001f600 and more text to run the sampler on. ")
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=48, n=2, logprobs=2, prompt_logprobs=1, stop=stop)
    runs = {}
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
        engine.clear_cache()
        engine.add_request("r", prompt, replace(params, output_kind=kind))
        runs[kind] = []
        while engine.has_unfinished_requests():
            runs[kind] += engine.step()
    cumulative, deltas = runs[RequestOutputKind.CUMULATIVE], runs[RequestOutputKind.DELTA]
    assert len(cumulative) == len(deltas) >= 24
    assert deltas[0].prompt_logprobs == cumulative[0].prompt_logprobs is not None
    assert all(d.prompt_logprobs is None for d in deltas[1:])
    fields = ("index", "text", "token_ids", "finish_reason", "stop_reason", "logprobs", "cumulative_logprob",
              "num_cached_tokens")
    total = None
    for step, (whole, delta) in enumerate(zip(cumulative, deltas)):
        assert sum(len(c.token_ids) for c in delta.outputs) <= 2 * max(1, engine.config.stream_interval)
        total = delta if total is None else add_delta(total, delta)
        assert total.finished == whole.finished and total.num_cached_tokens == whole.num_cached_tokens
        for got, want in zip(total.outputs, whole.outputs, strict=True):
            assert [getattr(got, f) for f in fields] == [getattr(want, f) for f in fields], step
    assert total.finished and all(len(c.token_ids) for c in total.outputs)
    assert any(c.token_ids and not c.text for d in deltas for c in d.outputs)  # text held back for later steps
    engine.check_integrity()


def test_a_stream_interval_sends_a_streamed_request_every_n_tokens_and_times_the_rest():
    """`stream_interval` 3 (vLLM's `--stream-interval`): a streamed request's outputs come at its first token, then
    every 3 tokens and at its end; the steps between report its tokens in `step_progress`; the final output is the
    one an interval of 1 gives."""
    from hybridcache.config import EngineConfig
    from hybridcache.engine.engine import LLMEngine

    finals, shown = {}, {}
    for interval in (1, 3):
        engine = LLMEngine(None, EngineConfig(block_size=16, max_model_len=512, stream_interval=interval))
        prompt = engine.tokenizer.encode("Streamed every few tokens, whole at the end")
        engine.add_request("s", prompt, SamplingParams(temperature=0, max_tokens=11, ignore_eos=True))
        counts, progress, outputs = [], [], []
        while engine.has_unfinished_requests():
            outputs += engine.step()
            progress += [p.num_output_tokens[0] for p in engine.step_progress()]
        engine.check_integrity()
        counts = [len(out.outputs[0].token_ids) for out in outputs]
        finals[interval] = (outputs[-1].finished, outputs[-1].outputs[0].token_ids, outputs[-1].outputs[0].text)
        shown[interval] = (counts, progress)
    assert shown[1] == (list(range(1, 12)), [])
    assert shown[3] == ([1, 4, 7, 10, 11], [2, 3, 5, 6, 8, 9])
    assert finals[1] == finals[3]
