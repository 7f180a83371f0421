"""The swe-agent workload keeps the function-calling agents' observations (role "tool") and actions (an assistant
message's `tool_calls`): a call's prompt is the chat template's rendering of every message before it. The loader
kept only system/user/assistant messages and the slice had dropped the tool calls (hunt 129)."""

import importlib.util
import json
from pathlib import Path

from hybridcache.bench.workloads import default_trace_path, load_workload
from hybridcache.bench.workloads.swe_agent import load_swe_agent
from hybridcache.bench.workloads.text import ChatEncoder
from hybridcache.models.builtin import build_byte_tokenizer

REPO = Path(__file__).resolve().parents[2]


def _call(name, arguments, call_id):
    return {"function": {"arguments": json.dumps(arguments), "name": name}, "id": call_id, "type": "function"}


HISTORY = [
    {"role": "system", "content": "You are an agent."},
    {"role": "user", "content": "Fix the bug."},
    {"role": "assistant", "content": "Let me look.", "tool_calls": [_call("find_file", {"name": "a.py"}, "c1")]},
    {"role": "tool", "content": "Found a.py", "tool_call_ids": ["c1"]},
    {"role": "assistant", "content": "", "tool_calls": [_call("open", {"path": "a.py"}, "c2"),
                                                         _call("ls", {}, "c3")]},
    {"role": "tool", "content": "1: def f()", "tool_call_ids": ["c2"]},
    {"role": "tool", "content": "a.py b.py", "tool_call_ids": ["c3"]},
    {"role": "assistant", "content": "Done.", "tool_calls": [_call("submit", {}, "c4")]},
]


def _as_template_takes_it(message):
    kept = {"role": message["role"], "content": message["content"]}
    return {**kept, "tool_calls": message["tool_calls"]} if "tool_calls" in message else kept


def test_every_call_prompt_is_the_rendering_of_the_history_before_it(tmp_path):
    (tmp_path / "run.traj").write_text(json.dumps({"history": HISTORY}))
    encoder = ChatEncoder()
    (session,) = load_swe_agent(tmp_path, encoder)
    requests = list(session.recorded_requests())
    calls = [j for j, m in enumerate(HISTORY) if m["role"] == "assistant"]
    assert len(requests) == len(calls) == 3
    messages = [_as_template_takes_it(m) for m in HISTORY]
    for request, j in zip(requests, calls):
        assert request.prompt_ids == encoder.encode(encoder.render(messages[:j]))
    text = encoder.render(messages[: calls[-1]])
    assert "Found a.py" in text and "a.py b.py" in text and '"name": "open"' in text  # observations and actions
    # the reply is the content and the calls (what the model emits), then the end-of-turn token
    first_reply = encoder.encode('Let me look.\n<tool_call>\n{"name": "find_file", "arguments": {"name": "a.py"}}\n'
                                 "</tool_call><|im_end|>")
    assert requests[0].output_ids == first_reply


def test_a_null_content_renders_as_no_text(tmp_path):
    """OpenAI's shape of a message that only calls tools, `"content": null`, rendered as the text "None" (in its
    recorded reply and every later prompt); it is empty, as the server renders it."""
    history = [{**m, "content": None} if m.get("content") == "" else m for m in HISTORY]
    (tmp_path / "run.traj").write_text(json.dumps({"history": history}))
    encoder = ChatEncoder()
    requests = list(load_swe_agent(tmp_path, encoder)[0].recorded_requests())
    (tmp_path / "run.traj").write_text(json.dumps({"history": HISTORY}))
    assert requests == list(load_swe_agent(tmp_path, encoder)[0].recorded_requests())


def test_the_shipped_function_calling_trajectory_keeps_observations_and_actions():
    path = default_trace_path("swe-agent") / "demonstrations" / "function_calling_simple.traj"
    history = json.loads(path.read_text())["history"]
    observations = [m["content"] for m in history if m["role"] == "tool"]
    actions = [c["function"]["name"] for m in history for c in m.get("tool_calls", [])]
    assert len(observations) == len(actions) == 5
    last = [r for r in load_workload("swe-agent") if "function_calling_simple" in r.session_id][-1]
    text = build_byte_tokenizer().decode(list(last.prompt_ids), skip_special_tokens=False)
    assert all(o.replace("\r", "")[:40] in text.replace("\r", "") for o in observations[:-1])
    assert all(f'"name": "{a}"' in text for a in actions[:-1])


def test_make_trace_slices_keeps_tool_calls_and_leaves_an_absent_part(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("make_trace_slices", REPO / "scripts" / "make_trace_slices.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    source, out = tmp_path / "source", tmp_path / "out"
    trajectories = source / "swe_agent" / "trajectories" / "demonstrations"
    trajectories.mkdir(parents=True)
    full = [{**m, "agent": "main", "message_type": "action", "thought": "t"} for m in HISTORY]
    (trajectories / "run.traj").write_text(json.dumps({"environment": "e", "trajectory": [], "history": full}))
    (source / "swe_agent" / "LICENSE").write_text("MIT License")
    monkeypatch.setattr(script, "OUT", out)
    script.main(source)  # no mooncake part in the source: left as it is (here: not written)
    cut = json.loads((out / "swe_agent" / "trajectories" / "demonstrations" / "run.traj").read_text())
    assert cut == {"history": [{k: m[k] for k in ("role", "agent", "content", "tool_calls", "tool_call_ids") if k in m}
                               for m in full]}
    assert cut["history"][2]["tool_calls"] == HISTORY[2]["tool_calls"]
    assert not (out / "mooncake").exists()
