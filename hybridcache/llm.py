"""The offline API: `LLM(model=None, **engine_options).generate(prompts, sampling_params)` and
`.chat(messages, sampling_params)`; `close()` (or a `with LLM(...) as llm:` block) frees the engine."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tqdm.auto import tqdm

from hybridcache.engine.engine import LLMEngine
from hybridcache.engine_args import resolve_engine_config
from hybridcache.generation_config import GenerationConfigSource, SamplingDefaults
from hybridcache.model_path import resolve_model
from hybridcache.outputs import RequestOutput
from hybridcache.sampling import SamplingParams

Prompt = str | list[int]
Message = dict[str, object]


class LLM:
    """Offline batched generation.

    `model`: a model folder, a Hugging Face snapshot folder, or a hub id held by the local Hugging Face cache
    (see `hybridcache.model_path`); None uses the built-in model. `engine_options` are the fields of
    `EngineConfig` (block_size, max_num_seqs, enable_prefix_caching, mamba_ssm_cache_dtype, ...); `dtype`,
    `device` and `mamba_ssm_cache_dtype` also take "auto", as on the command line (`LLM` itself defaults to
    EngineConfig's float32 on cpu, with a float32 recurrent state). A bad option is a ValueError raised before
    any weights load.
    `generation_config`: "auto" takes the sampling defaults of calls without sampling params from the model
    folder's generation_config.json, "vllm" ignores the file (see `hybridcache.generation_config`).
    `close()`, or leaving a `with LLM(...) as llm:` block, frees the model and the pools and stops
    tensor-parallel workers (a process runs one tensor-parallel group at a time: close one `LLM` before the
    next); the `LLM` refuses work afterwards.
    """

    def __init__(self, model: str | Path | None = None, *,
                 generation_config: GenerationConfigSource | str = GenerationConfigSource.AUTO,
                 **engine_options) -> None:
        resolved = resolve_model(model)
        self.model_name = resolved.name
        self.sampling_defaults = SamplingDefaults.from_model_dir(resolved.path, generation_config)
        self.engine = LLMEngine(resolved.path, resolve_engine_config(resolved.path, engine_options))
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0

    def close(self) -> None:
        """Free the engine: abort what runs, stop tensor-parallel workers, drop the model and pools (idempotent;
        `generate` and `chat` then raise `EngineDeadError`)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use when given no sampling params: the model folder's generation config
        defaults (unless `generation_config="vllm"`) over SamplingParams' own, as in vLLM."""
        return self.sampling_defaults.sampling_params()

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to conversations: `messages` is one conversation (a list of `{"role", "content"}`
        dicts) or a list of them. Each is rendered with the model's chat template (`Tokenizer.apply_chat_template`,
        as the server does) and generated as that text, so `chat(m, p)` equals
        `generate(tokenizer.apply_chat_template(m), p)`; each output's `prompt` is the rendered text."""
        messages = list(messages)
        conversations = [messages] if not messages or isinstance(messages[0], dict) else [list(c) for c in messages]
        for i, conversation in enumerate(conversations):
            for message in conversation:
                if not isinstance(message, dict):
                    raise TypeError(f"messages must be a list of message dicts or a list of such lists "
                                    f"(conversation {i} holds a {type(message).__name__})")
        prompts = [self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
                   for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate completions for every prompt, batched together; outputs come in prompt order.

        A prompt is a string or a list of token ids; a single prompt may be passed bare. Every prompt is
        validated before any is queued, so a bad prompt raises without running the others. Without
        `sampling_params`, `get_default_sampling_params()`.
        """
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        validated = [self.engine.validate_prompt(prompt) for prompt in prompts]  # tokenized here, once
        ids = []
        for prompt, params in zip(validated, params_list):
            request_id = str(self._next_id)
            self._next_id += 1
            self.engine.add_request(request_id, prompt, params, final_only=True)
            ids.append(request_id)
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
            try:
                while self.engine.has_unfinished_requests():
                    for output in self.engine.step():
                        if output.finished:
                            results[output.request_id] = output
                            bar.update(1)
            except BaseException:
                for request_id in ids:
                    self.engine.abort(request_id)
                raise
        return [results[request_id] for request_id in ids]
