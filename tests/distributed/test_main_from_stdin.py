"""A tensor-parallel `LLM` whose `__main__` cannot be re-imported (a script read on stdin: `python - < script`)
runs: the spawned workers never import `__main__` (they need only hybridcache), so they neither look for a
'<stdin>' file nor run the script's top level again. CPU gloo, TP = 2; its tokens equal the same model at TP = 1
run in the same script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.folders import write_folder

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_tensor_parallel_llm_from_a_script_on_stdin(tmp_path):
    model_dir = write_folder(tmp_path / "qwen3_next", "qwen3_next")
    # no `if __name__ == "__main__"` guard: under spawn a worker importing this script would run it again
    script = (
        "import json\n"
        "from hybridcache import LLM, SamplingParams\n"
        "params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)\n"
        "prompts = [list(range(3, 40)), list(range(50, 70))]\n"
        "tokens = {}\n"
        "for size in (2, 1):\n"
        f"    llm = LLM({str(model_dir)!r}, max_num_seqs=2, tensor_parallel_size=size)\n"
        "    tokens[size] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]\n"
        "    llm.engine.runner.shutdown()\n"
        "print('TOKENS', json.dumps(tokens), flush=True)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "FileNotFoundError" not in done.stderr
    line = next(line for line in done.stdout.splitlines() if line.startswith("TOKENS "))
    tokens = json.loads(line[len("TOKENS "):])
    assert tokens["2"] == tokens["1"] and all(len(t) == 6 for t in tokens["2"])
