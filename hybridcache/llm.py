"""The offline API: `LLM(model_path=None, **engine_options).generate(prompts, sampling_params)`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tqdm.auto import tqdm

from hybridcache.config import EngineConfig
from hybridcache.engine.engine import LLMEngine
from hybridcache.outputs import RequestOutput
from hybridcache.sampling import SamplingParams

Prompt = str | list[int]


class LLM:
    """Offline batched generation. `model_path=None` uses the built-in model; `engine_options` are the
    fields of `EngineConfig` (block_size, max_num_seqs, enable_prefix_caching, ...)."""

    def __init__(self, model_path: str | Path | None = None, **engine_options) -> None:
        self.engine = LLMEngine(model_path, EngineConfig(**engine_options))
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate completions for every prompt, batched together; outputs come in prompt order.

        A prompt is a string or a list of token ids; a single prompt may be passed bare. Every prompt is
        validated before any is queued, so a bad prompt raises without running the others.
        """
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        validated = [self.engine.validate_prompt(prompt) for prompt in prompts]  # tokenized here, once
        ids = []
        for prompt, params in zip(validated, params_list):
            request_id = str(self._next_id)
            self._next_id += 1
            self.engine.add_request(request_id, prompt, params)
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
