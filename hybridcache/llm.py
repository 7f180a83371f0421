"""The offline API: `LLM(model=None, **engine_options).generate(prompts, sampling_params)` and
`.chat(messages, sampling_params)`; `close()` (or a `with LLM(...) as llm:` block) frees the engine.

Images (models with a vision tower, e.g. Qwen3.5): `chat` takes OpenAI-style content parts
(`{"type": "image_url", "image_url": {"url": ...}}` with a data: URI, an http(s) URL or a local path under
`allowed_local_media_path`, or `{"type": "image", "image": <PIL image>}`); `generate` takes vLLM's
`{"prompt": ..., "multi_modal_data": {"image": <one or a list>}}`, whose prompt holds one `<|image_pad|>` per image.
At most `limit_mm_per_prompt["image"]` images a prompt. A bad image raises `hybridcache.images.ImageError` (a
ValueError) naming the reason before anything is queued; video is not supported.

Cache salts (vLLM's `cache_salt`): a dict prompt of `generate` may carry `"cache_salt": "<non-empty string>"`, and
`chat(..., cache_salt=...)` salts every conversation of the call; prompts share prefix-cache content only with
prompts of the same salt (none: with unsalted ones). See docs/cache.md, "Cache salts".
"""

from __future__ import annotations

import functools
import signal
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from hybridcache.engine.engine import (
    LLMEngine,
    ValidPrompt,
    check_cache_salt,  # (the engine's rule for its cache_salt)
    close_at_exit,
)
from hybridcache.engine_args import MODEL_OPTIONS, resolve_engine_config
from hybridcache.generation_config import GenerationConfigSource, SamplingDefaults
from hybridcache.images import ImageError, media_limits
from hybridcache.mm_processor import image_prompt, split_chat_images
from hybridcache.model_path import resolve_model
from hybridcache.multimodal import MultimodalInput
from hybridcache.outputs import RequestOutput
from hybridcache.sampling import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Prompt = str | list[int] | dict
Message = dict[str, object]


class LLM:
    """Offline batched generation.

    `model`: a model folder, a Hugging Face snapshot folder, or a hub id, from the local Hugging Face cache or
    downloaded into it (see `hybridcache.model_path`; vLLM's `revision` and `download_dir` keywords choose a hub
    id's revision and cache folder); None uses the built-in model. `engine_options` are the fields of
    `EngineConfig` (block_size, max_num_seqs, enable_prefix_caching, mamba_ssm_cache_dtype, ...); `dtype`,
    `device` and `mamba_ssm_cache_dtype` also take "auto", as on the command line (`LLM` itself defaults to
    EngineConfig's float32 on cpu, with a float32 recurrent state). A bad option is a ValueError raised before
    any weights load.
    `generation_config`: "auto" takes the sampling defaults of calls without sampling params from the model
    folder's generation_config.json, "vllm" ignores the file (see `hybridcache.generation_config`).
    `limit_mm_per_prompt` (e.g. `{"image": 4}`) and `allowed_local_media_path`: see the module docstring.
    `close()`, or leaving a `with LLM(...) as llm:` block, frees the model and the pools, stops
    tensor-parallel workers (a process runs one tensor-parallel group at a time: close one `LLM` before the
    next) and hands the cache to the disk tier when there is one (`disk_cache_dir`); the `LLM` refuses work
    afterwards. An engine still open when the interpreter exits is closed then (vLLM's `LLM` has no `close()`: a
    script written for it hands its cache to the disk tier too), and one with a disk tier dropped earlier without
    `close()` (an `LLM` made in a function that returned) when it is collected.
    """

    def __init__(self, model: str | Path | None = None, *,
                 generation_config: GenerationConfigSource | str = GenerationConfigSource.AUTO,
                 limit_mm_per_prompt: dict[str, int] | None = None,
                 allowed_local_media_path: str | Path | None = None,
                 **engine_options) -> None:
        self.media_limits = media_limits(limit_mm_per_prompt, allowed_local_media_path)
        resolved = resolve_model(model, **{name: engine_options.pop(name, None) for name in MODEL_OPTIONS})
        self.model_name = resolved.name
        self.sampling_defaults = SamplingDefaults.from_model_dir(resolved.path, generation_config)
        self.engine = LLMEngine(resolved.path, resolve_engine_config(resolved.path, engine_options))
        # closed at the interpreter's exit if still open then; a weak reference: `LLM(...).engine` is a user's
        # engine, kept while they hold it, not closed with its wrapper
        close_at_exit(self.engine)
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0

    def close(self) -> None:
        """Free the engine: abort what runs, stop tensor-parallel workers, hand the cache to the disk tier, drop
        the model and pools (idempotent; `generate` and `chat` then raise `EngineDeadError`)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        """The model's transformers tokenizer, as vLLM's `LLM.get_tokenizer()` returns it (`encode`, `decode`,
        `apply_chat_template(..., tokenize=False)`, `eos_token_id`, ...). `llm.tokenizer` is hybridcache's own
        `Tokenizer` around it (`encode` without special tokens, the chat template `chat` renders with)."""
        return self.tokenizer.hf

    def reset_prefix_cache(self) -> bool:
        """Drop everything the prefix cache holds (its host and disk tiers' entries too), as vLLM's
        `LLM.reset_prefix_cache()` (benchmarks call it between runs); False, and nothing dropped, while requests
        run (vLLM's: their blocks are not freed yet)."""
        if self.engine.has_unfinished_requests():
            return False
        self.engine.clear_cache()
        return True

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use when given no sampling params: the model folder's generation config
        defaults (unless `generation_config="vllm"`) over SamplingParams' own, as in vLLM."""
        return self.sampling_defaults.sampling_params()

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations: `messages` is one conversation (a list of `{"role", "content"}`
        dicts) or a list of them. Each is rendered with the model's chat template (`Tokenizer.apply_chat_template`,
        as the server does) and generated as that text, so `chat(m, p)` equals
        `generate(tokenizer.apply_chat_template(m), p)`; each output's `prompt` is the rendered text.

        Messages are taken as the server takes them (`mm_processor.split_chat_images`): a role of
        `CHAT_ROLES` (else ValueError), content a string or OpenAI-style parts, text parts joined into one
        string; image parts render as one placeholder each and their images go with the prompt
        (`multi_modal_data`). As vLLM's `LLM.chat`: `add_generation_prompt` (the assistant header after the
        conversation), `continue_final_message` (leave the last message open to be continued; it takes the place
        of the generation prompt, as on the server), `tools` (tool definitions the template renders) and
        `chat_template_kwargs` (extra template variables, e.g. `{"enable_thinking": False}`) and `chat_template` (a
        Jinja template to use instead of the folder's). `cache_salt`: every conversation's cache salt (as a
        `generate` dict prompt's `"cache_salt"`; vLLM's server takes it on a chat request)."""
        messages = list(messages)
        conversations = [messages] if not messages or isinstance(messages[0], dict) else [list(c) for c in messages]
        for i, conversation in enumerate(conversations):
            for message in conversation:
                if not isinstance(message, dict):
                    raise TypeError(f"messages must be a list of message dicts or a list of such lists "
                                    f"(conversation {i} holds a {type(message).__name__})")
        template = {"tools": tools, "template_kwargs": chat_template_kwargs, "chat_template": chat_template}
        opens_reply = add_generation_prompt and not continue_final_message
        prompts: list[Prompt] = []
        partings: list[Callable[[Sequence[int]], int | None]] = []  # where each next turn will part (its ids)
        for conversation in conversations:
            rendered, images = split_chat_images(conversation)
            if images and self.engine.image_processor is None:  # refused before a text-only template meets them
                image_prompt(None, [], images, self.media_limits)
            text = self.tokenizer.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=continue_final_message, **template)
            # a dict even without images: placeholders the text holds are then refused, as the server does
            prompts.append({"prompt": text, "multi_modal_data": {"image": images},
                            **({} if cache_salt is None else {"cache_salt": cache_salt})})
            partings.append(functools.partial(self.tokenizer.parting_step, rendered, text, **template) if opens_reply
                            else lambda ids: None)
        return self._generate(prompts, sampling_params, use_tqdm=use_tqdm, partings=partings)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
    ) -> list[RequestOutput]:
        """Generate completions for every prompt, batched together; outputs come in prompt order.

        A prompt is a string, a list of token ids, or `{"prompt": <either>, "multi_modal_data": {"image": ...},
        "cache_salt": <a non-empty string>}` (vLLM's TextPrompt / TokensPrompt: `prompt_token_ids` for the ids;
        each key but the prompt optional); a single prompt may be passed bare. Every prompt is validated (its
        images loaded, processed and encoded; its salt checked) before any is queued, so a bad prompt raises without
        running the others. Without `sampling_params`, `get_default_sampling_params()`. `use_tqdm`: show a progress
        bar, or (as vLLM's) a callable that builds it (tqdm's arguments). A Ctrl-C is raised once the engine step
        in progress ends: the call's requests are aborted and the engine stays usable (a second one is raised at
        once; see `_InterruptsBetweenSteps`).
        """
        return self._generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _generate(self, prompts: Prompt | Sequence[Prompt],
                  sampling_params: SamplingParams | Sequence[SamplingParams] | None, *,
                  use_tqdm: bool | Callable[..., Any],
                  partings: Sequence[Callable[[Sequence[int]], int | None]] | None = None) -> list[RequestOutput]:
        """`generate`; `partings[i](ids)`: the step of prompt i's ids where later prompts will part from it
        (`chat`'s `Tokenizer.parting_step`), or None: a checkpoint is asked for there (`LLMEngine.add_request`'s
        `checkpoints_at`)."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts)
        ):
            prompts = [prompts]
        if not isinstance(prompts, Iterable):
            raise TypeError(f"prompts must be a prompt (text, token ids or a dict) or a list of them, got "
                            f"{type(prompts).__name__}")
        prompts = list(prompts)
        default = self.get_default_sampling_params()
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or default] * len(prompts)
        elif isinstance(sampling_params, (Sequence, Iterator)) and not isinstance(sampling_params, str):
            params_list = [default if params is None else params for params in sampling_params]
            if len(params_list) != len(prompts):
                raise ValueError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
            for i, params in enumerate(params_list):
                if not isinstance(params, SamplingParams):
                    raise TypeError(f"sampling_params[{i}] must be a SamplingParams, got {type(params).__name__}")
        else:  # a dict is not a SamplingParams: vLLM's generate takes none either
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them (one per prompt), got "
                            f"{type(sampling_params).__name__}")
        validated = [self._validate(prompt) for prompt in prompts]  # tokenized here, once
        salts = [_cache_salt(prompt) for prompt in prompts]
        validated = self._encode_images(validated)
        ids = []
        results: dict[str, RequestOutput] = {}
        bar_class = use_tqdm if callable(use_tqdm) else tqdm  # vLLM's: a callable builds the progress bar
        # the bar comes first (a bar that fails queues nothing); Ctrl-C is raised between steps (see the class)
        with (bar_class(total=len(validated), desc="generate", unit="req", disable=not use_tqdm) as bar,
              _InterruptsBetweenSteps() as interrupts):
            try:
                for i, ((prompt, mm_inputs), params) in enumerate(zip(validated, params_list)):
                    request_id = str(self._next_id)
                    self._next_id += 1
                    step = partings[i](prompt.token_ids) if partings else None
                    hints = (step,) if step else ()
                    params = replace(params.up_to(self.engine.max_model_len - len(prompt.token_ids)),  # max_tokens=None
                                     output_kind=RequestOutputKind.FINAL_ONLY)
                    self.engine.add_request(request_id, prompt, params, mm_inputs, checkpoints_at=hints,
                                            cache_salt=salts[i])
                    ids.append(request_id)
                interrupts.raise_held()
                while self.engine.has_unfinished_requests():
                    for output in self.engine.step():
                        if output.finished:
                            results[output.request_id] = output
                            bar.update(1)
                    interrupts.raise_held()
            except BaseException:  # e.g. a refused image, or Ctrl-C: nothing of this call stays queued
                for request_id in ids:
                    self.engine.abort(request_id)
                raise
        return [results[request_id] for request_id in ids]

    def _encode_images(self, validated: list[tuple[ValidPrompt, tuple[MultimodalInput, ...]]]
                       ) -> list[tuple[ValidPrompt, tuple[MultimodalInput, ...]]]:
        """Every prompt's images through the vision tower in one `VisionEncoder.encode` (batched tower calls)."""
        spans = [span for _, prompt_spans in validated for span in prompt_spans]
        if not spans or self.engine.vision is None:
            return validated
        encoded = iter(self.engine.vision.encode(spans))
        return [(prompt, tuple(next(encoded) for _ in prompt_spans)) for prompt, prompt_spans in validated]

    def _validate(self, prompt: Prompt) -> tuple[ValidPrompt, tuple[MultimodalInput, ...]]:
        """The prompt checked and tokenized, with its images loaded and processed into spans (placeholders
        expanded); ValueError / ImageError naming what is wrong."""
        if not isinstance(prompt, dict):
            return self.engine.validate_prompt(prompt), ()
        unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data", "cache_salt"}
        if unknown:
            raise ValueError(f"a prompt dict takes 'prompt' (or 'prompt_token_ids'), 'multi_modal_data' and "
                             f"'cache_salt', not {sorted(unknown)}")
        data = dict(prompt.get("multi_modal_data") or {})
        images = data.pop("image", None)
        if data:
            raise ImageError(f"multi_modal_data {sorted(data)} is not supported (only 'image'; no video)")
        if "prompt" in prompt and "prompt_token_ids" in prompt:
            raise ValueError("a prompt dict takes 'prompt' or 'prompt_token_ids', not both")
        text = prompt.get("prompt", prompt.get("prompt_token_ids"))
        valid = self.engine.validate_prompt(text)
        sources = [] if images is None else list(images) if isinstance(images, (list, tuple)) else [images]
        ids, spans = image_prompt(self.engine.image_processor, valid.token_ids, sources, self.media_limits)
        return ValidPrompt(valid.text, self.engine.validate_prompt(ids).token_ids), spans


class _InterruptsBetweenSteps:
    """`generate`'s Ctrl-C: inside it, on the main thread under Python's default SIGINT handler, a Ctrl-C is held
    until the engine step in progress (or the request being queued) is done, and `raise_held` raises it there as
    KeyboardInterrupt, where `generate` aborts its requests and the engine stays usable (an interrupt inside a step
    leaves the engine failed: `EngineDeadError`). A second Ctrl-C while one is held (a step that hangs) is raised
    at once. The handler before is restored on the way out. Elsewhere (another thread, an application's own SIGINT
    handler) it changes nothing."""

    def __init__(self) -> None:
        self.held = False
        self._previous: Any = None

    def __enter__(self) -> _InterruptsBetweenSteps:
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            self._previous = signal.signal(signal.SIGINT, self._hold)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _hold(self, signum: int, frame: object) -> None:
        if self.held:  # a second Ctrl-C: the step does not end, stop it here
            raise KeyboardInterrupt
        self.held = True

    def raise_held(self) -> None:
        """Raise the Ctrl-C held during the step that just ended, if any."""
        if self.held:
            self.held = False
            raise KeyboardInterrupt


def _cache_salt(prompt: Prompt) -> str | None:
    """A dict prompt's `"cache_salt"` (None when it has none); ValueError unless a non-empty string, as vLLM's."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    check_cache_salt(salt)
    return salt
