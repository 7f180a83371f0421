"""The built-in model folder and the `hybridcache generate` command."""

import json

import pytest

from hybridcache import LLM, SamplingParams
from hybridcache.cli import main
from hybridcache.models import ModelConfig
from hybridcache.models.builtin import builtin_model_dir, ensure_builtin_model
from hybridcache.tokenizer import Tokenizer


def test_builtin_model_is_a_real_model_folder():
    path = ensure_builtin_model()
    assert path == builtin_model_dir()
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in path.iterdir()}
    assert list(path.glob("*.safetensors"))
    config = ModelConfig.from_model_dir(path)
    assert config.architecture == "Qwen3_5ForCausalLM"
    assert config.layer_types.count("linear_attention") >= 3 and "full_attention" in config.layer_types
    tokenizer = Tokenizer(path)
    text = "héllo, wörld"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert ensure_builtin_model() == path  # the second call reuses the folder


def test_builtin_greedy_generate_is_deterministic():
    llm = LLM()
    params = SamplingParams(temperature=0, max_tokens=8)
    first = llm.generate(["The quick brown fox", "Hello"], params, use_tqdm=False)
    again = llm.generate(["The quick brown fox", "Hello"], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
    assert first[0].prompt == "The quick brown fox"
    assert first[0].prompt_token_ids == llm.tokenizer.encode("The quick brown fox")
    assert first[0].num_cached_tokens == 0


def test_cli_generate_prints_one_json_line_per_completion(capsys):
    assert main(["generate", "--prompt", "abc", "--prompt", "xyz", "--max-tokens", "4", "-n", "2",
                 "--temperature", "0.7", "--seed", "3"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["prompt"], r["completion"]) for r in lines] == [("abc", 0), ("abc", 1), ("xyz", 0), ("xyz", 1)]
    assert all(1 <= r["num_tokens"] <= 4 for r in lines)


def test_cli_generate_hands_its_cache_to_the_disk_tier_so_a_rerun_hits(capsys, tmp_path):
    """`generate --disk-cache-dir` never closed its engine: nothing was written at exit and a rerun hit nothing
    (the docs: a restarted engine finds it)."""
    prompt = "The disk tier keeps what the cache held when the engine closes. " * 5
    run = ["generate", "--prompt", prompt, "--max-tokens", "2", "--temperature", "0", "--host-cache-gib", "0.01",
           "--disk-cache-dir", str(tmp_path)]
    cached = []
    for _ in range(2):
        assert main(run) == 0
        cached.append(json.loads(capsys.readouterr().out.splitlines()[0])["cached_tokens"])
    assert cached[0] == 0 and cached[1] > 64
    assert list(tmp_path.rglob("*.safetensors"))


def test_cli_reports_bad_input_as_an_error(capsys):
    assert main(["generate", "--prompt", "abc", "--max-tokens", "0"]) == 2
    assert "max_tokens" in capsys.readouterr().err


def test_chat_equals_generate_on_the_rendered_prompt():
    llm = LLM()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    rendered = llm.tokenizer.apply_chat_template(conversation)
    [chat] = llm.chat(conversation, params, use_tqdm=False)
    [plain] = llm.generate(rendered, params, use_tqdm=False)
    assert chat.prompt == rendered
    assert chat.prompt_token_ids == plain.prompt_token_ids == llm.tokenizer.encode(rendered)
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids
    other = [{"role": "user", "content": "another"}]
    batch = llm.chat([conversation, other], params, use_tqdm=False)
    assert [o.prompt for o in batch] == [rendered, llm.tokenizer.apply_chat_template(other)]
    assert batch[0].outputs[0].token_ids == plain.outputs[0].token_ids
    continued = llm.chat(other, params, add_generation_prompt=False, use_tqdm=False)
    assert continued[0].prompt == llm.tokenizer.apply_chat_template(other, add_generation_prompt=False)


def test_chat_rejects_what_is_not_messages():
    llm = LLM()
    with pytest.raises(TypeError, match="message dicts"):
        llm.chat(["hello"], use_tqdm=False)


def test_generate_refuses_what_is_not_prompts_or_params_and_serves_on():
    """Input the hunt found reaching deep errors (or running with the wrong parameters) is refused up front, naming
    the argument; a None in the params list is the default; a tuple of ids is one prompt, as a list is."""
    llm = LLM()
    greedy = SamplingParams(temperature=0, max_tokens=3)
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams"):
        llm.generate(["a"], {"max_tokens": 2}, use_tqdm=False)
    with pytest.raises(TypeError, match="prompts must be"):
        llm.generate(None, use_tqdm=False)
    with pytest.raises(ValueError, match="not both"):
        llm.generate({"prompt": "a", "prompt_token_ids": [1, 2]}, use_tqdm=False)
    for steps in ([0], [3], [True], [1.5]):
        with pytest.raises(ValueError, match="checkpoints_at must hold prompt steps in \\[1, 3\\)"):
            llm.engine.add_request("hinted", [1, 2, 3], greedy, checkpoints_at=steps)
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_integrity()
    default = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    llm.get_default_sampling_params = lambda: default  # (a generation_config.json's defaults, say)
    outputs = llm.generate(["hi", "hi"], [greedy, None], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 5]
    as_tuple, as_list = (llm.generate(ids, greedy, use_tqdm=False) for ids in ((104, 105), [104, 105]))
    assert len(as_tuple) == 1 and as_tuple[0].outputs[0].token_ids == as_list[0].outputs[0].token_ids


THINKING_GENERATION_PROMPT = ("{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
                              "{% endif -%}")


LAST_REPLY_THINKS = """{%- for m in messages -%}
{%- if m.role == 'assistant' and loop.last -%}<|im_start|>assistant
<think>
</think>

{{ m.content }}<|im_end|>
{% else -%}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_start|>assistant
<think>
{% endif -%}"""


@pytest.mark.parametrize("template", ["builtin-think", "last-reply-thinks"])
def test_a_chat_turn_hits_the_whole_previous_conversation_when_the_template_drops_its_reply_prefix(template):
    """Qwen3's and Qwen3.5's templates open a think block in the generation prompt (`<|im_start|>assistant\\n<think>
    \\n`) and render earlier replies without it, so the next turn parts from this prompt right after
    `<|im_start|>assistant\\n`: no checkpoint lay there (the prompt's end is past it), and turn 2 took nothing from
    the cache. `chat` asks for a checkpoint where the next turn will part (`Tokenizer.parting_step`): turn 2 hits
    all of turn 1's conversation and the reply's header. "last-reply-thinks" renders the reply after the last user
    message with a think block and earlier ones without (Qwen3's rule), so the next turn's own rendering, with a user
    message after the reply, is what tells where it parts."""
    llm = LLM()
    builtin = llm.tokenizer.chat_template
    assert THINKING_GENERATION_PROMPT in builtin
    llm.tokenizer.chat_template = (builtin.replace(THINKING_GENERATION_PROMPT, "<think>\n")
                                   if template == "builtin-think" else LAST_REPLY_THINKS)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    turn1 = [{"role": "system", "content": "You answer briefly. " * 8}, {"role": "user", "content": "Why? " * 12}]
    reply = llm.chat(turn1, greedy, use_tqdm=False)[0].outputs[0].text
    turn2 = [*turn1, {"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}]
    # turn 2 parts from turn 1's prompt after "<|im_start|>assistant\n", before "<think>\n"
    prompt = llm.tokenizer.apply_chat_template(turn1)
    parting = len(llm.tokenizer.encode(prompt[: prompt.rindex("<think>")]))
    assert parting > 150
    assert llm.chat(turn2, greedy, use_tqdm=False)[0].outputs[0].num_cached_tokens == parting
    llm.engine.check_integrity()
