"""A `vllm serve`-style command line starts `hybridcache serve` and answers: the tool-call flags, `--chat-template
PATH` (not taken as an abbreviation of `--chat-template-kwargs`), `--root-path`, the log flags,
`--trust-remote-code` and `--enable-force-include-usage`; and the flags' parsing on its own."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import httpx
import pytest
from openai import OpenAI

from hybridcache.cli import build_parser
from hybridcache.extras import MissingExtra, require_extra
from hybridcache.models.builtin import BUILTIN_NAME
from hybridcache.server.vllm_flags import chat_template, uvicorn_options
from tests.server.server_process import REPO, SMALL_ENGINE, free_port, running_server

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\nFROM THE FILE {{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_vllm_command_line_starts_and_answers(tmp_path, tokenizer):
    template_file = tmp_path / "template.jinja"
    template_file.write_text(TEMPLATE)
    args = ("--served-model-name", "my-model", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--chat-template", str(template_file), "--root-path", "/proxy", "--uvicorn-log-level", "warning",
            "--disable-log-requests", "--trust-remote-code", "--enable-force-include-usage", *SMALL_ENGINE)
    with running_server(*args, tmp_dir=tmp_path) as server:
        client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "hello"}]
        response = client.chat.completions.create(model="my-model", messages=messages, max_tokens=4, temperature=0)
        rendered = TEMPLATE.replace("{% for m in messages %}", "").split("{% endfor %}")[0]
        rendered = rendered.replace("{{ m.role }}", "user").replace("{{ m.content }}", "hello")
        rendered += "<|im_start|>assistant\n"
        assert response.usage.prompt_tokens == len(tokenizer.encode(rendered))  # the file's template rendered
        assert response.choices[0].finish_reason in ("stop", "length")
        # usage in every stream, though the client did not ask for it (LangChain, openai-agents do not)
        chunks = list(client.chat.completions.create(model="my-model", messages=messages, max_tokens=3,
                                                     temperature=0, stream=True))
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
        assert all(c.usage is None for c in chunks[:-1])
        text_chunks = list(client.completions.create(model="my-model", prompt="hi", max_tokens=3, stream=True))
        assert text_chunks[-1].usage.prompt_tokens == len(tokenizer.encode("hi"))


def test_flags_parse_as_vllm_spells_them(tmp_path):
    args = parse("--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder", "--ssl-keyfile", "k.pem",
                 "--ssl-certfile", "c.pem", "--root-path", "/api", "--uvicorn-log-level", "debug")
    assert args.enable_auto_tool_choice and args.tool_call_parser == "qwen3_coder"
    assert uvicorn_options(args) == {"root_path": "/api", "ssl_keyfile": "k.pem", "ssl_certfile": "c.pem",
                                     "log_level": "debug", "uds": None, "access_log": False}
    assert uvicorn_options(parse("--log-level", "warning"))["log_level"] == "warning"
    for name in ("hermes", "qwen3_xml", "qwen25"):
        assert parse("--tool-call-parser", name).tool_call_parser == name
    with pytest.raises(SystemExit):
        parse("--tool-call-parser", "mistral")  # a format this server does not parse
    # no abbreviations: --chat-template is its own flag, and a prefix of a flag is refused
    template_file = tmp_path / "t.jinja"
    template_file.write_text(TEMPLATE)
    args = parse("--chat-template", str(template_file))
    assert chat_template(args) == TEMPLATE and args.chat_template_kwargs is None
    assert chat_template(parse("--chat-template", "{{ messages[0].content }}")) == "{{ messages[0].content }}"
    with pytest.raises(ValueError, match="no such file"):
        chat_template(parse("--chat-template", str(tmp_path / "missing.jinja")))
    with pytest.raises(SystemExit):
        parse("--chat-template-kw", json.dumps({"enable_thinking": False}))
    with pytest.raises(SystemExit):
        parse("--served-model", "x")


def test_ssl_flags_go_together():
    from hybridcache.server.vllm_flags import check_vllm_args

    with pytest.raises(SystemExit, match="go together"):
        check_vllm_args(parse("--ssl-keyfile", "k.pem"))
    check_vllm_args(parse("--trust-remote-code"))


def test_missing_extra_names_the_distribution(monkeypatch, capsys):
    import hybridcache.extras as extras
    from hybridcache.cli import main

    real = extras.find_spec
    monkeypatch.setattr(extras, "find_spec", lambda module: None if module == "uvicorn" else real(module))
    with pytest.raises(MissingExtra, match=r"pip install 'hybridcache-llm\[serve\]'"):
        require_extra("serve", "hybridcache serve")
    assert main(["serve", "--served-model-name", BUILTIN_NAME]) == 2
    assert "pip install 'hybridcache-llm[serve]'" in capsys.readouterr().err


def test_router_and_data_parallel_serve_name_the_missing_extra(monkeypatch, capsys):
    """`hybridcache router` and `serve --data-parallel-size 2` without the serve extra ended in a traceback
    (ModuleNotFoundError: uvicorn) where `serve` names the extra (hunt 182)."""
    import sys

    import hybridcache.extras as extras
    from hybridcache.cli import main

    real = extras.find_spec
    monkeypatch.setattr(extras, "find_spec", lambda module: None if module == "uvicorn" else real(module))
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # `import uvicorn` fails, as when it is not installed
    monkeypatch.delitem(sys.modules, "hybridcache.server.uvicorn_server", raising=False)
    for argv in (["router", "--replica", "http://127.0.0.1:1"],
                 ["serve", "--data-parallel-size", "2", "--device", "cpu", "--port", "1"]):
        assert main(argv) == 2, argv
        assert "pip install 'hybridcache-llm[serve]'" in capsys.readouterr().err, argv


def test_logs_name_the_builtin_model_as_it_is_served(tmp_path):
    from hybridcache.models.builtin import builtin_model_dir, model_display_name

    assert model_display_name(builtin_model_dir()) == BUILTIN_NAME
    assert model_display_name(tmp_path / "my-model") == "my-model"


def test_ssl_flags_serve_https(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a self-signed certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1"], check=True, capture_output=True)
    port = free_port()
    log_path = tmp_path / "server.log"
    command = [sys.executable, "-m", "hybridcache.cli", "serve", "--port", str(port), "--log-level", "warning",
               "--ssl-keyfile", str(key), "--ssl-certfile", str(cert), *SMALL_ENGINE]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert process.poll() is None, log_path.read_text()
            try:
                health = httpx.get(f"https://127.0.0.1:{port}/health", verify=False, timeout=1.0)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.2)
        assert health.status_code == 200
        with pytest.raises(httpx.HTTPError):  # plain HTTP is not served
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2.0)
    finally:
        process.kill()
        process.wait(timeout=30)
