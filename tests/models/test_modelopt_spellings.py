"""The `quantization_config` spellings NVIDIA ModelOpt's Hugging Face export has written into config.json, as its
source says (github.com/NVIDIA/Model-Optimizer, `modelopt/torch/export/convert_hf_config.py`,
`convert_hf_quant_config_format`, called by `unified_export_hf.py` since 0.31.0; every version also writes the
nested `hf_quant_config.json` beside it):

- 0.31.0 (2025-06): the flat fields `config_groups`, `ignore`, `quant_algo`, `kv_cache_scheme` as the string "FP8",
  `producer`; no `quant_method`;
- 0.33.0 (2025-07-14): the same plus `quant_library: "modelopt"`; still no `quant_method`;
- 0.35.0 on (commit 4c611e47a, 2025-07-31): `quant_method: "modelopt"`, `kv_cache_scheme` as
  {"dynamic": false, "num_bits": 8, "type": "float"}, the FP8 group's `targets: ["Linear"]`.

The producer versions of the published Nemotron-H FP8 checkpoints could not be read offline (their config.json files
were not found), so each spelling is checked here: the loader reads FP8 weights by their scale tensors whichever
spelling the file has (`quant.checkpoint_format`)."""

from __future__ import annotations

import json

import pytest

from hybridcache.fp8_format import CHANNEL
from hybridcache.models.quant import checkpoint_format, read_quantization_config

_GROUP = {"input_activations": {"dynamic": False, "num_bits": 8, "type": "float"},
          "weights": {"dynamic": False, "num_bits": 8, "type": "float"}}
_IGNORE = ["lm_head", "backbone.layers.5.mixer.in_proj", "backbone.layers.6.mixer.q_proj"]
# config.json's quantization_config as each ModelOpt version wrote it for quant_algo FP8 with FP8 KV (module docstring)
MODELOPT_0_31 = {"config_groups": {"group_0": _GROUP}, "ignore": _IGNORE, "quant_algo": "FP8",
                 "kv_cache_scheme": "FP8", "producer": {"name": "modelopt", "version": "0.31.0"}}
MODELOPT_0_33 = {**MODELOPT_0_31, "producer": {"name": "modelopt", "version": "0.33.0"}, "quant_library": "modelopt"}
MODELOPT_0_35 = {"config_groups": {"group_0": {**_GROUP, "targets": ["Linear"]}}, "ignore": _IGNORE,
                 "quant_algo": "FP8", "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"},
                 "producer": {"name": "modelopt", "version": "0.35.0"}, "quant_method": "modelopt"}
# hf_quant_config.json (every version)
HF_QUANT_CONFIG = {"producer": {"name": "modelopt", "version": "0.31.0"},
                   "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": _IGNORE}}


@pytest.mark.parametrize("written", [MODELOPT_0_31, MODELOPT_0_33, MODELOPT_0_35],
                         ids=["modelopt-0.31", "modelopt-0.33", "modelopt-0.35"])
def test_every_modelopt_config_json_spelling_reads_as_fp8_per_channel(written, tmp_path):
    """Each version's config.json is read as ModelOpt FP8 (run per channel), also from a folder with
    hf_quant_config.json beside it; before, 0.31's and 0.33's (no quant_method) were refused as
    "quant_method None"."""
    assert checkpoint_format(written) == CHANNEL
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NemotronHForCausalLM"],
                                                      "quantization_config": written}))
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(HF_QUANT_CONFIG))
    assert checkpoint_format(read_quantization_config(tmp_path)) == CHANNEL


def test_the_nested_hf_quant_config_json_alone_reads_as_fp8(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NemotronHForCausalLM"]}))
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(HF_QUANT_CONFIG))
    assert checkpoint_format(read_quantization_config(tmp_path)) == CHANNEL


@pytest.mark.parametrize("written, message", [
    ({**MODELOPT_0_33, "quant_algo": "NVFP4"}, "ModelOpt quant_algo 'NVFP4' is not supported"),
    ({**MODELOPT_0_31, "kv_cache_scheme": "NVFP4"}, "ModelOpt KV cache quantisation 'NVFP4'"),
    ({key: value for key, value in MODELOPT_0_31.items() if key != "producer"}, "quant_method None"),
    ({**MODELOPT_0_31, "producer": {"name": "llm-compressor"}}, "quant_method None"),
])
def test_a_modelopt_file_of_another_format_is_refused_naming_it(written, message):
    """Without quant_method, only a file ModelOpt marks as its own (`quant_library` or `producer.name`) is read as
    ModelOpt; what it describes is then checked as any ModelOpt file."""
    with pytest.raises(ValueError, match=message):
        checkpoint_format(written)
