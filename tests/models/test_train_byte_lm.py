"""benchmarks/train_byte_lm.py: a few training steps lower the held-out loss (the model's, then its MTP head's), and
the folder it writes loads in `LLM` with the logits transformers computes on the same folder (the bf16 agreement
measurement runs on it) and the trained MTP head in the MTP loader."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from benchmarks.train_byte_lm import CORPUS_FILE, RECORD_FILE, TrainOptions, corpus_bytes, train
from hybridcache import LLM
from hybridcache.models import load_model
from hybridcache.models.mtp import MTP_FILE, load_mtp_head
from hybridcache.sampling import SamplingParams
from tests.engine.model_folders import load_hf_model

from .helpers import rel_err

PROMPT_LEN = 200


def test_training_lowers_the_loss_and_the_folder_matches_transformers(tmp_path):
    corpus = corpus_bytes()[:60_000]
    options = TrainOptions(steps=8, batch=4, seq_len=256, log_every=4, seed=1, mtp_steps=4)
    record = train(tmp_path, options, corpus=corpus, shape={})  # tiny_hf_config's shape: hidden 64
    assert record["held_out_loss"] < record["held_out_loss_before"] - 1.0, record
    mtp = record["mtp"]  # the MTP head, trained after the model, predicts the byte after next better than before
    assert mtp["held_out_loss"] < mtp["held_out_loss_before"] - 0.3, mtp
    assert mtp["held_out_next_next_accuracy"] > mtp["held_out_next_next_accuracy_before"], mtp
    trained = load_file(str(tmp_path / MTP_FILE))
    head = load_mtp_head(tmp_path, load_model(tmp_path), dtype=torch.float32, device="cpu")
    assert torch.equal(head.fc.weight, trained["mtp.fc.weight"])
    assert [step for step, _ in record["losses"]] == [4, 8]
    assert (tmp_path / CORPUS_FILE).read_bytes() == corpus
    assert json.loads((tmp_path / RECORD_FILE).read_text())["corpus"]["bytes"] == len(corpus)

    prompt = list(corpus[1_000:1_000 + PROMPT_LEN])
    llm = LLM(tmp_path, dtype="float32", device="cpu")
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=20, prompt_logprobs=20)
    (output,) = llm.generate([prompt], params, use_tqdm=False)

    hf = load_hf_model(tmp_path)
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([prompt]), position_ids=torch.arange(PROMPT_LEN)[None],
                    use_cache=False).logits[0].float()
    want = logits.log_softmax(dim=-1)
    # The first sampled token: its top 20 (ids and log-probabilities) against transformers' last position.
    first = output.outputs[0].logprobs[0]
    top = want[-1].topk(20)
    assert [token for token, _ in first.top] == top.indices.tolist()
    assert rel_err(torch.tensor([lp for _, lp in first.top]), top.values) <= 1e-4
    # Every prompt position: the log-probability of the next prompt byte and of the 20 likeliest.
    ours, ref = [], []
    for position in range(1, PROMPT_LEN):
        for token, logprob in output.prompt_logprobs[position].items():
            ours.append(logprob.logprob)
            ref.append(want[position - 1, token])
    assert len(ours) >= 20 * (PROMPT_LEN - 1)
    assert rel_err(torch.tensor(ours), torch.stack(ref)) <= 1e-4
