"""The MTP head: loading `mtp.*` tensors (Qwen3.5 dense and MoE, Qwen3-Next; per-expert or stacked experts), the
loader's errors, and its KV: a chunked run over a sequence equals one forward over all of it."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridcache.engine.input_builder import SeqChunk, build_forward_batch
from hybridcache.kernels.backend import ReferenceBackend
from hybridcache.models import ModelConfig, load_model
from hybridcache.models.mtp import MTP_FILE, check_mtp_head, check_mtp_model_type, load_mtp_head
from hybridcache.state_spec import DevicePools
from tests.engine.model_folders import write_tiny_model

MODEL_TYPES = ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"]


@pytest.fixture(scope="module", params=MODEL_TYPES)
def folder(request, tmp_path_factory):
    if request.param == "qwen3_5_moe_text":
        import transformers

        from hybridcache.models.random_weights import randomize_, tiny_hf_config
        from tests.engine.model_folders import save_model_folder

        config = tiny_hf_config("qwen3_5_moe_text", vocab_size=320, eos_token_id=258)
        model = transformers.Qwen3_5MoeForCausalLM(config).eval()
        randomize_(model, seed=0)
        return save_model_folder(model, tmp_path_factory.mktemp(request.param))
    return write_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


def test_every_random_folder_has_a_head_and_it_loads_exactly(folder):
    tensors = load_file(str(folder / MTP_FILE))
    config = json.loads((folder / "config.json").read_text())
    assert (config.get("mtp_num_hidden_layers") or config.get("num_nextn_predict_layers")) == 1
    head = load_mtp_head(folder, load_model(folder), dtype=torch.float32, device="cpu")
    params = dict(head.named_parameters())
    assert {f"mtp.{name}" for name in params} == set(tensors)
    for name, param in params.items():
        assert torch.equal(param, tensors[f"mtp.{name}"]), name
    moe = any(".experts." in name for name in tensors)
    assert moe == ("moe" in folder.name or "next" in folder.name)


def test_stacked_experts_load_like_per_expert_ones(tmp_path):
    folder = write_tiny_model(tmp_path, "qwen3_next")
    tensors = load_file(str(folder / MTP_FILE))
    want = load_mtp_head(folder, load_model(folder), dtype=torch.float32, device="cpu").state_dict()
    prefix = "mtp.layers.0.mlp.experts"
    num = 1 + max(int(n[len(prefix) + 1:].split(".")[0]) for n in tensors if n.startswith(prefix + "."))
    stacked = {n: t for n, t in tensors.items() if not n.startswith(prefix + ".")}
    stacked[f"{prefix}.gate_up_proj"] = torch.stack([
        torch.cat([tensors[f"{prefix}.{e}.gate_proj.weight"], tensors[f"{prefix}.{e}.up_proj.weight"]])
        for e in range(num)])
    stacked[f"{prefix}.down_proj"] = torch.stack([tensors[f"{prefix}.{e}.down_proj.weight"] for e in range(num)])
    save_file(stacked, str(folder / MTP_FILE))
    got = load_mtp_head(folder, load_model(folder), dtype=torch.float32, device="cpu").state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)


@pytest.mark.parametrize("damage, message", [
    ("drop", "missing tensor 'mtp.layers.0.self_attn.q_proj.weight'"),
    ("shape", "shape mismatch for tensor 'mtp.fc.weight'"),
    ("extra", "unexpected tensor 'mtp.layers.0.bogus.weight'"),
    ("count", "declares 2 MTP layers, the checkpoint holds 1"),
    ("integer", r"checkpoint tensor 'mtp.fc.weight' in \S+mtp.safetensors has dtype I32; a weight must be a float"),
])
def test_a_damaged_head_is_refused_with_the_tensor_named(tmp_path, damage, message):
    folder = write_tiny_model(tmp_path, "qwen3_5_text")
    tensors = load_file(str(folder / MTP_FILE))
    if damage == "drop":
        del tensors["mtp.layers.0.self_attn.q_proj.weight"]
    elif damage == "shape":
        tensors["mtp.fc.weight"] = tensors["mtp.fc.weight"][:, :-1].contiguous()
    elif damage == "extra":
        tensors["mtp.layers.0.bogus.weight"] = torch.zeros(2)
    elif damage == "integer":
        tensors["mtp.fc.weight"] = tensors["mtp.fc.weight"].to(torch.int32)
    else:
        config = json.loads((folder / "config.json").read_text())
        config["mtp_num_hidden_layers"] = 2
        (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / MTP_FILE))
    pattern = message if damage == "integer" else message.replace("(", r"\(")
    with pytest.raises(ValueError, match=pattern):
        load_mtp_head(folder, load_model(folder), dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match=pattern):  # the same error from the headers alone (before the target loads)
        check_mtp_head(folder)


def test_the_tensor_parallel_pre_check_is_the_same_header_check(tmp_path):
    """The tensor-parallel executor checks the head before starting its ranks with `check_mtp_head` too: a broken
    head (not only a missing one or a layer count that does not split) is refused there."""
    from hybridcache.layers.parallel import TensorParallel

    folder = write_tiny_model(tmp_path, "qwen3_next")
    tensors = load_file(str(folder / MTP_FILE))
    tensors["mtp.fc.weight"] = tensors["mtp.fc.weight"][:, :-1].contiguous()
    save_file(tensors, str(folder / MTP_FILE))
    with pytest.raises(ValueError, match="shape mismatch for tensor 'mtp.fc.weight'"):
        check_mtp_head(folder, TensorParallel(0, 2))


@pytest.mark.parametrize("damage", ["no-head", "broken-head"])
def test_an_mtp_engine_refuses_a_folder_before_the_target_loads(tmp_path, monkeypatch, damage):
    """speculative method "mtp" on one rank: a folder without an MTP head, or with a broken one, was refused only
    after the target model's weights were read in full (minutes for an 80B checkpoint)."""
    import hybridcache.engine.rank_runner as rank_runner
    from hybridcache import LLM

    folder = write_tiny_model(tmp_path, "qwen3_5_text")
    if damage == "no-head":
        (folder / MTP_FILE).unlink()
        message = "has no mtp.* tensors: speculative method 'mtp' needs the model's MTP head"
    else:
        tensors = load_file(str(folder / MTP_FILE))
        del tensors["mtp.fc.weight"]
        save_file(tensors, str(folder / MTP_FILE))
        message = "missing tensor 'mtp.fc.weight'"

    def load_model_not_expected(*args, **kwargs):
        raise AssertionError("the target model loaded before the MTP head was checked")

    monkeypatch.setattr(rank_runner, "load_model", load_model_not_expected)
    with pytest.raises(ValueError, match=re.escape(message)):
        LLM(model=str(folder), device="cpu", speculative_config={"method": "mtp", "num_speculative_tokens": 1})


def test_the_head_over_chunks_equals_one_forward(folder):
    """Rows [0, 150) at once, against [0, 70), [70, 149) and a one-row step at 149 (the drafter's pattern): the
    head's KV written by earlier calls is what later ones read."""
    model = load_model(folder)
    head = load_mtp_head(folder, model, dtype=torch.float32, device="cpu")
    backend = ReferenceBackend()
    generator = torch.Generator().manual_seed(5)
    num, hidden_size = 150, model.config.hidden_size
    tokens = torch.randint(0, 256, (num,), generator=generator).tolist()
    target = torch.randn(num, hidden_size, generator=generator)
    blocks = list(range(10))

    def run(pieces):
        pools = DevicePools.allocate(head.state_specs(torch.float32), num_pages=20, kernel_block_size=8,
                                     num_slots=1)
        outs = []
        for start, end in pieces:
            batch = build_forward_batch([SeqChunk(tokens[start:end], start, blocks, 0)], block_size=16,
                                        kernel_block_size=8)
            embeds = model.model.embed_tokens(batch.input_ids)
            outs.append(head(embeds, target[start:end], backend.prepare(batch), pools.layers, backend))
        return torch.cat(outs)

    whole = run([(0, num)])
    pieces = run([(0, 70), (70, 149), (149, 150)])
    assert (pieces - whole).abs().max() <= 1e-5 * whole.abs().max()
    assert whole.abs().max() > 0.1  # a head that computes something


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])
def test_the_head_equals_one_built_from_transformers_layers(tmp_path, model_type):
    """The head built from transformers' own decoder layer and norms (`benchmarks/train_byte_lm.MtpTrainer`), random
    weights at std 1/sqrt(fan_in), written as the folder's `mtp.*` tensors: our head's logits over 150 positions
    (its paged KV written as it goes) equal the transformers-built head's, given the same target hidden states."""
    from benchmarks.train_byte_lm import MtpTrainer, save_mtp
    from hybridcache.models.random_weights import randomize_
    from tests.engine.model_folders import load_hf_model

    folder = write_tiny_model(tmp_path, model_type, seed=2)
    hf = load_hf_model(folder)
    reference = MtpTrainer(hf).eval()
    randomize_(reference, seed=9)
    save_mtp(reference, folder)
    num = 152
    windows = torch.randint(0, 256, (1, num), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = reference.logits(hf, windows)[0]
        target_hidden = hf.model(input_ids=windows[:, :-2], position_ids=torch.arange(num - 2)[None],
                                 use_cache=False).last_hidden_state[0]

    model = load_model(folder)
    head = load_mtp_head(folder, model, dtype=torch.float32, device="cpu")
    backend = ReferenceBackend()
    pools = DevicePools.allocate(head.state_specs(torch.float32), num_pages=20, kernel_block_size=8, num_slots=1)
    tokens = windows[0, 1:-1].tolist()
    outs = []
    for start, end in ((0, 70), (70, num - 2)):
        batch = build_forward_batch([SeqChunk(tokens[start:end], start, list(range(10)), 0)], block_size=16,
                                    kernel_block_size=8)
        embeds = model.model.embed_tokens(batch.input_ids)
        outs.append(head(embeds, target_hidden[start:end], backend.prepare(batch), pools.layers, backend))
    got = model._logits(torch.cat(outs))
    assert (got - want).abs().max() <= 1e-4 * want.abs().max(), float((got - want).abs().max())


def test_checkpoint_kv_scales_reach_the_target_and_the_head_with_fp8_kv(tmp_path):
    """A folder's per-layer FP8 KV scales (`...self_attn.k_scale` / `v_scale`, vLLM's names) set the scales of the
    target's attention layers and, for `mtp.*` ones, of the head's; without FP8 KV they are read past."""
    folder = write_tiny_model(tmp_path, "qwen3_next")
    model = load_model(folder)
    attention = next(name for name, module in model.named_modules() if hasattr(module, "kv_dtype"))
    head_attention = next(name for name, module in load_mtp_head(folder, model, dtype=torch.float32,
                                                                  device="cpu").named_modules()
                          if hasattr(module, "kv_dtype"))
    scales = {f"{attention}.k_scale": 0.5, f"{attention}.v_scale": 0.25,
              f"mtp.{head_attention}.k_scale": 2.0, f"mtp.{head_attention}.v_scale": 4.0}
    save_file({name: torch.tensor(value) for name, value in scales.items()}, str(folder / "kv_scales.safetensors"))
    target = load_model(folder, kv_fp8=True)
    head = load_mtp_head(folder, target, dtype=torch.float32, device="cpu", kv_fp8=True)
    for module, name, want in [(target, attention, (0.5, 0.25)), (head, head_attention, (2.0, 4.0))]:
        layer = dict(module.named_modules())[name]
        assert (layer.kv_dtype, layer.k_scale, layer.v_scale) == (torch.float8_e4m3fn, *want)
    plain = load_mtp_head(folder, load_model(folder), dtype=torch.float32, device="cpu")
    assert dict(plain.named_modules())[head_attention].kv_dtype is None


def _family_config(family: str) -> ModelConfig:
    from tests.models.bamba_helpers import bamba_config
    from tests.models.falcon_h1_helpers import falcon_config
    from tests.models.granite_helpers import granite_config
    from tests.models.jamba_helpers import jamba_config
    from tests.models.nemotron_helpers import nemotron_config

    make, variant = {"granite": (granite_config, "dense-rope"), "bamba": (bamba_config, "groups2"),
                     "falcon": (falcon_config, "norm-first"), "jamba": (jamba_config, "dense"),
                     "nemotron": (nemotron_config, "groups2")}[family]
    return ModelConfig.from_dict(make(variant).to_dict())


@pytest.mark.parametrize("family", ["granite", "bamba", "falcon", "jamba"])
def test_mtp_on_a_model_without_mtp_layers_says_it_has_none(family):
    """Granite-4.0-H, Bamba, Falcon-H1 and Jamba have no MTP layers: speculative 'mtp' is refused saying so (it said
    the head was 'not the MTP layers of model_type 'jamba'', as if the model had some of another design)."""
    config = _family_config(family)
    message = f"speculative method 'mtp' needs a model with MTP layers; {config.architecture} has none"
    with pytest.raises(ValueError, match=re.escape(message)) as refused:
        check_mtp_model_type(config)
    assert "not the MTP layers" not in str(refused.value)


def test_mtp_on_a_model_with_other_mtp_layers_names_the_design():
    """Nemotron 3's MTP layers are not the Qwen head this engine drafts with: the refusal says that, not 'has none';
    the Qwen model types pass."""
    config = _family_config("nemotron")
    with pytest.raises(ValueError, match=re.escape("'mtp' is not supported for NemotronHForCausalLM: this head is "
                                                   "Qwen3.5's / Qwen3-Next's")) as refused:
        check_mtp_model_type(config)
    assert "not the MTP layers of model_type 'nemotron_h'" in str(refused.value)
    for model_type in MODEL_TYPES:
        assert check_mtp_model_type(replace(config, model_type=model_type)) is None
