"""Real `vllm serve` command lines (vLLM's Qwen3-Next / Qwen3.5 recipes, its MTP docs, the model cards) parse as
`hybridcache serve` and mean what they mean in vLLM (hunt 188): `--allowed-origins` as a JSON list, flag names with
underscores and dotted JSON keys, `-dp`, `--default-chat-template-kwargs`, several `--api-key`s, `--config
FILE.yaml`, and the flags accepted as logged no-ops."""

from __future__ import annotations

import argparse
import json
import logging
import shutil

import pytest
from starlette.requests import Request

from hybridcache.cli import main, parse_args
from hybridcache.engine_args import engine_options, model_argument, model_options, resolve_engine_config
from hybridcache.models.builtin import builtin_model_dir, ensure_builtin_model
from hybridcache.router.app import RouterConfig, has_key
from hybridcache.router.cli import replica_argv, router_config
from hybridcache.server.cli import api_keys, served_media_limits, server_config
from hybridcache.server.vllm_flags import check_vllm_args
from tests.server.test_app_query_and_cors import client


def serve(*argv: str) -> argparse.Namespace:
    return parse_args(["serve", *argv])


def bearer(key: str) -> Request:
    return Request({"type": "http", "headers": [(b"authorization", f"Bearer {key}".encode())]})


# ---- 1. --allowed-origins '["https://example.com"]' --------------------------------------------------------------


@pytest.mark.parametrize("command", ["serve", "router"])
def test_allowed_origins_take_vllms_json_list_and_plain_origins(command):
    extra = ["--replica", "http://127.0.0.1:9"] if command == "router" else []
    args = parse_args([command, *extra, "--allowed-origins", '["https://a.example", "https://b.example"]',
                       "--allowed-origins", "https://c.example"])
    config = server_config(args, ("m",)) if command == "serve" else router_config(args, args.replica)
    assert config.allowed_origins == ("https://a.example", "https://b.example", "https://c.example")


@pytest.mark.parametrize("value", ['["https://a.example"', '[1, 2]', '[["https://a.example"]]'])
def test_an_allowed_origins_value_in_brackets_that_is_not_a_json_list_of_strings_is_refused(value, capsys):
    with pytest.raises(SystemExit) as exited:
        serve("--allowed-origins", value)
    assert exited.value.code == 2
    assert "argument --allowed-origins: not a JSON list of origins" in capsys.readouterr().err


# ---- 2. --max_model_len, --speculative_config, --speculative-config.method ---------------------------------------


def test_underscored_flag_names_are_the_dashed_ones():
    args = serve("M", "--max_model_len", "4096", "--speculative_config", '{"method":"mtp","num_speculative_tokens":1}',
                 "--mamba_ssm_cache_dtype=float32", "--served_model_name", "a", "b")
    options = engine_options(args)
    assert (options["max_model_len"], options["mamba_ssm_cache_dtype"]) == (4096, "float32")
    assert json.loads(options["speculative_config"]) == {"method": "mtp", "num_speculative_tokens": 1}
    assert args.served_model_name == ["a", "b"]


def test_dotted_keys_fold_into_one_json_object_per_flag():
    args = serve("--speculative-config.method", "mtp", "--speculative_config.num_speculative_tokens", "2",
                 "--compilation_config.cudagraph_mode=PIECEWISE", "--limit-mm-per-prompt.image", "2",
                 "--compilation-config.pass_config.fuse=true")
    assert json.loads(args.speculative_config) == {"method": "mtp", "num_speculative_tokens": 2}
    assert args.compilation_config == {"cudagraph_mode": "PIECEWISE", "pass_config": {"fuse": True}}
    assert args.limit_mm_per_prompt == {"image": 2}


def test_flag_values_and_unknown_flags_are_left_alone(capsys):
    args = serve("--chat-template-kwargs", '{"enable_thinking": false, "a_b": 1}')
    assert args.chat_template_kwargs == {"enable_thinking": False, "a_b": 1}
    with pytest.raises(SystemExit):  # a flag not known here: argparse names it as it was given
        serve("M", "--structured-outputs-config.backend", "xgrammar")
    assert "unrecognized arguments: --structured-outputs-config.backend xgrammar" in capsys.readouterr().err


# ---- 3. -dp N ----------------------------------------------------------------------------------------------------


def test_dp_is_data_parallel_size_and_no_replica_gets_it():
    assert serve("-dp", "2").data_parallel_size == 2
    for dp in (["-dp", "2"], ["-dp=2"], ["--data_parallel_size", "2"]):
        argv = parse_args(["serve", "M", *dp, "--api-key", "k1", "k2"]).argv
        assert replica_argv(argv, 9001, 9.5) == ["serve", "M", "--api-key", "k1", "k2", "--host", "127.0.0.1",
                                                 "--port", "9001", "--shutdown-timeout", "9.5"]


# ---- 4. --default-chat-template-kwargs ---------------------------------------------------------------------------


def test_default_chat_template_kwargs_is_chat_template_kwargs():
    args = serve("--reasoning-parser", "qwen3", "--default-chat-template-kwargs", '{"enable_thinking": false}')
    assert server_config(args, ("m",)).default_chat_template_kwargs == {"enable_thinking": False}


# ---- 5. --api-key K1 K2 ------------------------------------------------------------------------------------------


def test_several_api_keys_each_open_the_server(monkeypatch):
    monkeypatch.delenv("HYBRIDCACHE_API_KEY", raising=False)
    config = server_config(serve("M", "--api-key", "k1", "k2"), ("m",))
    assert config.api_keys == ("k1", "k2")
    app = client(api_key=config.api_key, other_api_keys=config.other_api_keys)
    for key, status in (("k1", 200), ("k2", 200), ("k3", 401), ("k1k2", 401)):
        assert app.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == status, key


def test_the_router_takes_any_key_and_polls_with_the_first(monkeypatch):
    monkeypatch.delenv("HYBRIDCACHE_API_KEY", raising=False)
    config = router_config(parse_args(["router", "--replica", "http://127.0.0.1:9", "--api-key", "k1", "k2"]),
                           ["http://127.0.0.1:9"])
    assert (config.api_key, config.other_api_keys) == ("k1", ("k2",))
    assert [has_key(bearer(key), config.api_keys) for key in ("k1", "k2", "k3")] == [True, True, False]
    assert has_key(bearer("k"), "k") and not has_key(bearer("k"), "x") and has_key(bearer("x"), None)
    with pytest.raises(ValueError, match="other_api_keys need an api_key"):
        RouterConfig(("http://127.0.0.1:9",), other_api_keys=("k2",))


@pytest.mark.parametrize("model", ["acme/tiny-model", "DIR"])
def test_model_after_api_key_is_refused_without_showing_it(model, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("HYBRIDCACHE_API_KEY", raising=False)
    model = str(tmp_path) if model == "DIR" else model
    assert main(["serve", "--api-key", "sk-secret", model, "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "--api-key's value 2 looks like MODEL" in err and model not in err and "sk-secret" not in err
    assert api_keys(serve("M", "--api-key", "k1", "acme/k2")) == ("k1", "acme/k2")  # MODEL given: a key like any


def test_vllm_api_key_is_named_when_it_is_the_only_key(monkeypatch, caplog):
    monkeypatch.delenv("HYBRIDCACHE_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "vk")
    with caplog.at_level(logging.WARNING, logger="hybridcache.server"):
        assert api_keys(serve()) == ()
        assert api_keys(serve("--api-key", "k")) == ("k",)
    assert ["VLLM_API_KEY" in r.getMessage() for r in caplog.records] == [True]


# ---- 6. --config config.yaml -------------------------------------------------------------------------------------


def test_a_yaml_config_gives_flags_and_the_command_line_wins(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("max_model_len: 4096\nport: 9000\nenforce-eager: true\nenable-prefix-caching: false\n"
                      "served-model-name: [a, b]\nspeculative-config: {method: mtp, num_speculative_tokens: 1}\n"
                      "api-key: [k1, k2]\nallowed-origins: ['https://a.example']\ndata-parallel-size: 2\n")
    args = serve("M", "--config", str(config), "--port", "8001", "--served-model-name", "c")
    assert (args.model_arg, args.max_model_len, args.port, args.enforce_eager) == ("M", 4096, 8001, True)
    assert (args.enable_prefix_caching, args.served_model_name, args.api_key) == (False, ["c"], ["k1", "k2"])
    assert json.loads(args.speculative_config) == {"method": "mtp", "num_speculative_tokens": 1}
    assert args.allowed_origins == ["https://a.example"] and args.data_parallel_size == 2
    assert replica_argv(args.argv, 8002, 9.5).count("--data-parallel-size") == 0


def test_a_positional_model_wins_over_the_config_files_model(tmp_path):
    """vLLM serves MODEL when both `serve MODEL` and the --config file's `model:` name one (its model tag first);
    here that was "the model is given twice" (a config file shared by deployments could not be reused)."""
    config = tmp_path / "config.yaml"
    config.write_text("model: from/file\nport: 9000\n")
    args = serve("from/cli", "--config", str(config))
    assert (model_argument(args), args.port) == ("from/cli", 9000)
    assert model_argument(serve("--config", str(config))) == "from/file"
    # wherever MODEL stands (hunt 210: after a flag, or a flag's value, it was "given twice")
    for argv in (("--host", "0.0.0.0", "from/cli", "--config", str(config)),
                 ("--trust-remote-code", "from/cli", "--config", str(config)),
                 ("--config", str(config), "--port", "1", "from/cli"),
                 ("--api-key", "k1", "--max_model_len", "4096", "from/cli", "--config", str(config))):
        assert model_argument(serve(*argv)) == "from/cli", argv
    for argv in (("--max_model_len", "4096", "--config", str(config)),  # a flag's value is not MODEL
                 ("--served-model-name", "a", "b", "--config", str(config)),
                 ("--speculative-config.method", "mtp", "--config", str(config))):
        assert model_argument(serve(*argv)) == "from/file", argv
    with pytest.raises(ValueError, match="given twice"):  # both on the command line: still refused
        model_argument(serve("from/cli", "--model", "other/cli"))


@pytest.mark.parametrize("last", ["served-model-name: my-model", "allowed-origins: ['https://a.example']",
                                  "api-key: sk-x"])
def test_a_config_files_multi_value_flag_does_not_take_the_positional_model(tmp_path, last):
    """`serve MODEL --config cfg.yaml` (vLLM's documented form) with a multi-value flag last in the file: its items
    went before MODEL, so `--served-model-name my-model MODEL` took MODEL for a second name and the built-in model
    was served under the user's names (hunt 189). The file's items now come after the command line's."""
    config = tmp_path / "config.yaml"
    config.write_text(f"port: 9000\n{last}\n")
    args = serve("Qwen/Qwen3.5-0.8B", "--config", str(config))
    assert args.model_arg == "Qwen/Qwen3.5-0.8B" and args.port == 9000
    assert "Qwen/Qwen3.5-0.8B" not in (*(args.served_model_name or ()), *(args.allowed_origins or ()),
                                        *(args.api_key or ()))


@pytest.mark.parametrize("argv, wanted", [
    (["-O", '{"level": 3}'], {"level": 3}), (["-O.cudagraph_mode=FULL"], {"cudagraph_mode": "FULL"}),
    (["-O.level", "3"], {"level": 3}), (["-cc", '{"a": 1}'], {"a": 1}), (["-cc.mode=FULL"], {"mode": "FULL"}),
    (["-O3"], None), (["-O", "3"], None),
])
def test_vllms_short_names_of_the_compilation_config(argv, wanted):
    """vLLM's `-O` with a JSON object or dotted keys, and `-cc`, name --compilation-config (refused before: `-O`
    took an int only, `-cc` was unknown; hunt 189); `-O3` / `-O 3` stay the optimisation level."""
    args = serve("M", *argv)
    assert args.compilation_config == wanted
    assert args.optimization_level == (3 if wanted is None else None)


@pytest.mark.parametrize("text, message", [
    ("max-model-len: [1, 2]\n", "key 'max-model-len': --max-model-len takes one value, got a list"),
    ("no-such-flag: 1\n", "unknown key 'no-such-flag'"),
    ("enforce-eager: 3\n", "key 'enforce-eager': --enforce-eager is a switch that takes true or false, got 3"),
    ("port:\n", "key 'port': --port takes a value"),
    ("- a list\n", "expected a mapping"),
    ("a: [\n", "cannot read it as YAML"),
])
def test_a_bad_config_file_or_key_is_an_error_naming_both(tmp_path, text, message, capsys):
    config = tmp_path / "config.yaml"
    config.write_text(text)
    assert main(["serve", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert f"hybridcache: error: --config {config}: " in err and message in err, err
    assert main(["serve", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml: cannot read it" in capsys.readouterr().err


# ---- 7. accepted as logged no-ops, and --language-model-only --------------------------------------------------------


def test_vllm_performance_flags_are_logged_no_ops(caplog):
    ensure_builtin_model()
    args = serve("--enable-expert-parallel", "-O3", "--compilation-config", '{"cudagraph_mode": "PIECEWISE"}',
                 "--max-cudagraph-capture-size", "128", "--mm-encoder-tp-mode", "data", "--mm-processor-cache-type",
                 "shm", "--enable-log-requests", "--device", "cpu")
    with caplog.at_level(logging.INFO):
        resolve_engine_config(builtin_model_dir(), engine_options(args))
        check_vllm_args(args)
    logged = " ".join(r.getMessage() for r in caplog.records)
    for name in ("enable_expert_parallel", "optimization_level (-O)", "compilation_config",
                 "max_cudagraph_capture_size", "mm_encoder_tp_mode", "mm_processor_cache_type",
                 "--enable-log-requests"):
        assert f"{name} has no effect" in logged, name
    with pytest.raises(ValueError, match="cannot be turned off"):  # what would change results stays refused
        resolve_engine_config(builtin_model_dir(), engine_options(serve("--no_enable_chunked_prefill")))


def test_language_model_only_refuses_images():
    """...and says so (the refusal named --limit-mm-per-prompt, which the user had set to 2; hunt 194)."""
    from hybridcache.images import ImageError
    from hybridcache.mm_processor import image_prompt

    assert served_media_limits(serve("--limit-mm-per-prompt", '{"image": 2}')).max_images == 2
    limits = served_media_limits(serve("--language-model-only", "--limit-mm-per-prompt", '{"image": 2}'))
    assert limits.max_images == 0
    with pytest.raises(ImageError, match=r"the limit is 0 \(--language-model-only: no images\)"):
        image_prompt(object(), [1, 2], [b"not read"], limits)


def test_a_config_files_false_leaves_a_plain_switch_off_and_short_flags_on_the_command_line_win(tmp_path):
    """vLLM's config files list switches as `false`: vLLM leaves such a switch off, here it was refused; and a
    flag the command line gave as `-tp=2`, `-dp=2` or `-O3` lost to the file's value (only `--` spellings were
    seen as given; hunt 194)."""
    config = tmp_path / "config.yaml"
    config.write_text("enforce-eager: false\ntrust-remote-code: false\ntensor-parallel-size: 1\n"
                      "data-parallel-size: 1\noptimization-level: 0\n")
    args = serve("M", "--config", str(config), "-tp=2", "-dp=2", "-O3")
    assert (args.enforce_eager, args.tensor_parallel_size, args.data_parallel_size) == (False, 2, 2)
    assert args.optimization_level == 3


@pytest.mark.parametrize("argv, meant", [(["-d", "2"], "-dp"), (["-t", "2"], "-tp"), (["-d=2"], "-dp")])
def test_a_single_dash_prefix_is_not_taken_for_a_flag(argv, meant, capsys):
    """argparse matched `-d` to `-dp` and `-t` to `-tp` even with allow_abbrev=False: `serve -d 2` ran data
    parallelism and every replica, given `-d 2` again, tried to run its own (hunt 194). Refused, naming the flag."""
    assert main(["serve", "M", *argv]) == 2
    assert f"flags are never abbreviated (did you mean {meant}?)" in capsys.readouterr().err


def test_vllms_mamba_cache_dtype_sets_the_ssm_state_where_its_own_flag_is_auto():
    """`--mamba-cache-dtype` (vLLM's dtype of conv and ssm state) was an unknown flag: a deployment line with it did
    not start. The ssm state follows it unless --mamba-ssm-cache-dtype names one (vLLM's rule); the conv state
    stays in the model dtype here."""
    ensure_builtin_model()

    def ssm_dtype(*argv: str) -> str:
        return resolve_engine_config(builtin_model_dir(), engine_options(serve(*argv))).mamba_ssm_cache_dtype

    assert ssm_dtype("--mamba-cache-dtype", "bfloat16") == "bfloat16"
    assert ssm_dtype("--mamba-cache-dtype", "bfloat16", "--mamba-ssm-cache-dtype", "float16") == "float16"
    assert ssm_dtype("--mamba-cache-dtype", "auto") == ssm_dtype() == "float32"
    with pytest.raises(ValueError, match="mamba_cache_dtype 'fp8' must be one of auto, float32"):
        ssm_dtype("--mamba-cache-dtype", "fp8")


def test_hf_overrides_replace_config_items_for_everything_that_reads_the_folder(tmp_path, monkeypatch):
    """vLLM's `--hf-overrides JSON` (Qwen's long-context recipes pass rope parameters and max_position_embeddings
    with it) was an unknown flag. The folder is seen with the merged config.json (nested objects merged), through an
    overlay under $HYBRIDCACHE_HOME that links every other file; the original folder is untouched."""
    from hybridcache.model_path import resolve_model
    from hybridcache.models import ModelConfig

    monkeypatch.setenv("HYBRIDCACHE_HOME", str(tmp_path / "home"))
    folder = tmp_path / "tiny"
    shutil.copytree(ensure_builtin_model(), folder)
    original = json.loads((folder / "config.json").read_text())
    args = serve(str(folder), "--hf-overrides", '{"max_position_embeddings": 123456, "rope_parameters": {"x": 1}}')
    resolved = resolve_model(args.model_arg, **model_options(args))
    assert resolved.path != folder and resolved.path.name == folder.name and resolved.name == str(folder)
    merged = json.loads((resolved.path / "config.json").read_text())
    assert merged["max_position_embeddings"] == 123456
    assert merged["rope_parameters"] == {**original.get("rope_parameters", {}), "x": 1}
    assert ModelConfig.from_model_dir(resolved.path).attention.max_position_embeddings == 123456
    assert {p.name for p in resolved.path.iterdir()} == {p.name for p in folder.iterdir()}
    assert json.loads((folder / "config.json").read_text()) == original
    assert resolve_model(str(folder)).path == folder  # without overrides: the folder itself
    with pytest.raises(SystemExit):
        serve(str(folder), "--hf-overrides", "[1, 2]")  # not an object


def test_hf_overrides_built_by_processes_at_once(tmp_path, monkeypatch):
    """Data-parallel replicas build the same overlay at once: a link another process made after this one looked
    (the window forced open here: no link is ever seen as there) is taken as it is, and config.json is replaced
    whole (no partial file left beside it)."""
    from pathlib import Path

    from hybridcache.model_path import with_hf_overrides

    monkeypatch.setenv("HYBRIDCACHE_HOME", str(tmp_path / "home"))
    folder = tmp_path / "tiny"
    shutil.copytree(ensure_builtin_model(), folder)
    first = with_hf_overrides(folder, {"max_position_embeddings": 4321})
    overlay_parts = first.parts
    for check in ("exists", "is_symlink"):  # whichever the builder looks with: nothing in the overlay is seen there
        seen = getattr(Path, check)
        monkeypatch.setattr(Path, check, lambda self, seen=seen: self.parts[:len(overlay_parts)] != overlay_parts
                            and seen(self))
    again = with_hf_overrides(folder, {"max_position_embeddings": 4321})
    assert again == first
    assert json.loads((again / "config.json").read_text())["max_position_embeddings"] == 4321
    assert sorted(p.name for p in again.iterdir()) == sorted(p.name for p in folder.iterdir())


def test_nvidias_nemotron_3_recipe_starts(caplog):
    """NVIDIA's vLLM recipe for Nemotron 3 Nano (`--reasoning-parser-plugin nano_v3_reasoning_parser.py
    --reasoning-parser nano_v3 --tool-call-parser qwen3_coder`) did not start: the plugin flag was unknown and
    nano_v3 / nemotron_v3 not a choice. Nemotron 3's format is Qwen3's; the plugin file is not loaded (logged)."""
    for name in ("nano_v3", "nemotron_v3"):
        args = serve("--reasoning-parser-plugin", "nano_v3_reasoning_parser.py", "--reasoning-parser", name,
                     "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder")
        assert server_config(args, ("m",)).reasoning_parser.value == name
        with caplog.at_level(logging.INFO, logger="hybridcache.server"):
            check_vllm_args(args)
        assert any("nano_v3_reasoning_parser.py: not loaded" in r.getMessage() for r in caplog.records)
    assert serve("--tool-parser-plugin", "p.py").parser_plugin == "p.py"
