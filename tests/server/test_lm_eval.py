"""lm-evaluation-harness itself against a live server: its `local-completions` model runs a local multiple-choice task
(loglikelihoods: `echo` with `logprobs`, token-id prompts) and a generate_until task, and every loglikelihood it
reports equals the sum of the continuation tokens' logprobs from `LLM.generate(..., prompt_logprobs=0)` on the same
tokens, within 1e-4.

lm-eval is a heavy dependency (datasets, pandas, scikit-learn, ...): it is the `lmeval` extra, not `dev`, and this
test is slow and skipped when the package is missing (`pip install -e '.[lmeval]'`, then
`pytest -m slow tests/server/test_lm_eval.py`)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from hybridcache import LLM, SamplingParams
from hybridcache.config import EngineConfig
from hybridcache.models.builtin import BUILTIN_NAME, builtin_model_dir

from .inprocess_server import serving

DATA = Path(__file__).parent / "lm_eval_data"
ENGINE = EngineConfig(block_size=16, max_model_len=2048, num_blocks=2048)

MC_TASK = """\
task: hybridcache_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/multiple_choice.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""
GEN_TASK = """\
task: hybridcache_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/generate_until.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: answer
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""


@pytest.mark.slow
def test_lm_eval_local_completions_matches_prompt_logprobs(tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "mc.yaml").write_text(MC_TASK.format(data=DATA))
    (tasks / "gen.yaml").write_text(GEN_TASK.format(data=DATA))
    with serving(ENGINE) as base_url:
        lm = get_model("local-completions")(
            model=BUILTIN_NAME, base_url=f"{base_url}/v1/completions", tokenizer=str(builtin_model_dir()),
            tokenizer_backend="huggingface", tokenized_requests=True, num_concurrent=1, max_retries=1,
            max_length=2048, batch_size=2)
        results = lm_eval.simple_evaluate(model=lm, tasks=["hybridcache_mc", "hybridcache_gen"],
                                          task_manager=TaskManager(include_path=str(tasks)), log_samples=True,
                                          apply_chat_template=False)
    mc = results["samples"]["hybridcache_mc"]
    assert len(mc) == 4
    gen = results["samples"]["hybridcache_gen"]
    assert len(gen) == 2 and all(isinstance(s["resps"][0][0], str) for s in gen)
    assert 0.0 <= results["results"]["hybridcache_mc"]["acc,none"] <= 1.0

    pairs, reported = [], []
    for sample in mc:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
            pairs.append(lm._encode_pair(context, continuation))
            reported.append(resp[0][0])
    assert all(len(c) + len(x) >= 150 for c, x in pairs)
    llm = LLM(block_size=16, max_model_len=2048, num_blocks=2048)
    outputs = llm.generate([c + x for c, x in pairs], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    differences = []
    for (context, continuation), output, value in zip(pairs, outputs, reported):
        tokens = context + continuation
        expected = sum(output.prompt_logprobs[p][tokens[p]].logprob for p in range(len(context), len(tokens)))
        assert math.isfinite(value) and value < 0
        assert value == pytest.approx(expected, abs=1e-4)
        differences.append(abs(value - expected))
    print(f"\nlm-eval local-completions: {len(reported)} loglikelihoods, max |server - LLM.generate| "
          f"{max(differences):.2e}; acc {results['results']['hybridcache_mc']['acc,none']:.2f}, exact_match "
          f"{results['results']['hybridcache_gen']['exact_match,none']:.2f}")
