"""Sampling defaults from the model folder's `generation_config.json`, as vLLM takes them.

With `GenerationConfigSource.AUTO` (the default, `--generation-config auto`) the file's `temperature`, `top_p`,
`top_k`, `min_p`, `repetition_penalty` and `max_new_tokens` (as `max_tokens`) become the defaults of every
request that does not set them itself; with `VLLM` (`--generation-config vllm`) the file is ignored and the
defaults are `SamplingParams`' own. Other keys (`do_sample`, ...) are not sampling defaults. The file's
`eos_token_id` is no default either: whatever `--generation-config` says, its ids are stop tokens beside
config.json's and the tokenizer's EOS token (`ModelConfig.from_model_dir`), as vLLM stops on the tokenizer's
`eos_token_id` and the generation config's (unless a request sets `ignore_eos`).

Worked example: the file holds `{"temperature": 0.6, "top_p": 0.95, "do_sample": true}`; a request that sets
`temperature: 0` samples greedily with top_p 0.95; one that sets nothing samples at 0.6 with top_p 0.95.
"""

from __future__ import annotations

import argparse
import enum
import json
import logging
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridcache.sampling import SamplingParams

FILE_NAME = "generation_config.json"
_logger = logging.getLogger(__name__)


class GenerationConfigSource(enum.Enum):
    AUTO = "auto"
    VLLM = "vllm"


# generation_config.json key -> SamplingParams field
_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
         "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


@dataclass(frozen=True)
class SamplingDefaults:
    """Defaults for the SamplingParams fields a request leaves unset; None: SamplingParams' (or the endpoint's)
    own default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None

    @classmethod
    def from_model_dir(cls, model_dir: str | Path,
                       source: GenerationConfigSource | str = GenerationConfigSource.AUTO) -> SamplingDefaults:
        """The defaults `source` gives for the folder: none for VLLM or when the file is absent. A file that is
        not a JSON object gives none either, with a warning naming it (vLLM's try_get_generation_config falls back
        to the model config); a value that SamplingParams refuses is a ValueError naming the file and the key."""
        source = GenerationConfigSource(source)
        path = Path(model_dir) / FILE_NAME
        if source is GenerationConfigSource.VLLM or not path.is_file():
            return cls()
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            _logger.warning("%s is not valid JSON (%s): no sampling defaults from it", path, error)
            return cls()
        if not isinstance(data, dict):
            _logger.warning("%s must hold a JSON object, not %s: no sampling defaults from it", path,
                            type(data).__name__)
            return cls()
        values = {field: data[key] for key, field in _KEYS.items() if data.get(key) is not None}
        from hybridcache.sampling import SamplingParams  # here: the command line parses without torch

        try:
            SamplingParams(**values)
        except (ValueError, TypeError) as error:
            raise ValueError(f"{path}: {error} (pass --generation-config vllm to ignore the file)") from None
        return cls(**values)

    def as_dict(self) -> dict[str, Any]:
        """The fields that are set."""
        return {name: value for name, value in asdict(self).items() if value is not None}

    def sampling_params(self) -> SamplingParams:
        """SamplingParams with these defaults and SamplingParams' own for the rest."""
        from hybridcache.sampling import SamplingParams

        return SamplingParams(**self.as_dict())

    def pick(self, name: str, requested: Any, fallback: Any) -> Any:
        """`requested` when the request set it, else this default, else `fallback`."""
        if name not in {f.name for f in fields(self)}:
            raise KeyError(name)
        if requested is not None:
            return requested
        value = getattr(self, name)
        return fallback if value is None else value


def add_generation_config_arg(parser: argparse.ArgumentParser) -> None:
    """The `--generation-config auto|vllm` option of the commands that sample."""
    parser.add_argument(
        "--generation-config", default=GenerationConfigSource.AUTO.value,
        choices=[s.value for s in GenerationConfigSource],
        help="auto: the model folder's generation_config.json gives the defaults of temperature, top_p, top_k, "
             "min_p, repetition_penalty and max_new_tokens (as max_tokens) for requests that leave them unset; "
             "vllm: ignore the file (default: auto)")
