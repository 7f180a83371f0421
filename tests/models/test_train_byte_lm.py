"""benchmarks/train_byte_lm.py: a few training steps lower the held-out loss (the model's, then its MTP head's), and
the folder it writes loads in `LLM` with the logits transformers computes on the same folder (the bf16 agreement
measurement runs on it) and the trained MTP head in the MTP loader."""

from __future__ import annotations

import json
from pathlib import Path

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
    # A frozen corpus (the first 60,000 bytes of this repository's README.md and docs/*.md as they once were), not
    # the checkout's: a documentation edit changes what 8 steps can learn, and with it the loss this test bounds.
    corpus = (Path(__file__).parent / "data" / "byte_lm_corpus.txt").read_bytes()
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


def test_the_head_trains_on_cached_hidden_states_equal_to_a_fresh_forward(monkeypatch):
    """`train_mtp` runs the frozen model ahead of the head's steps, several steps' windows per forward: each step
    gets the windows it drew before (a generator seeded with seed + 1, `batch` random offsets per step, in step
    order), and hidden states equal to a forward over that step's windows alone; the head's logits from them
    equal its logits when it runs the model itself."""
    import transformers

    from benchmarks import train_byte_lm
    from benchmarks.train_byte_lm import MtpTrainer, frozen_hidden, split, training_windows
    from hybridcache.models.random_weights import randomize_
    from tests.engine.model_folders import HF_CLASSES, byte_config

    monkeypatch.setattr(train_byte_lm, "FROZEN_WINDOWS", 8)  # 2 steps of 4 windows per forward; 5 steps: 2 + 2 + 1
    options = TrainOptions(batch=4, seq_len=256, seed=3, mtp_steps=5)
    model = getattr(transformers, HF_CLASSES["qwen3_next"])(byte_config("qwen3_next")).eval().requires_grad_(False)
    randomize_(model, seed=5)
    train_bytes, _ = split(corpus_bytes()[:40_000])
    got = list(training_windows(model, train_bytes, options))
    assert len(got) == options.mtp_steps
    generator = torch.Generator().manual_seed(options.seed + 1)
    offsets = torch.arange(options.seq_len + 1)
    head = MtpTrainer(model).eval()
    randomize_(head, seed=6)
    for windows, hidden in got:
        starts = torch.randint(0, len(train_bytes) - options.seq_len - 1, (options.batch,), generator=generator)
        assert torch.equal(windows, train_bytes[starts[:, None] + offsets])
        positions = torch.arange(options.seq_len - 1).expand(options.batch, -1)
        fresh = model.model(input_ids=windows[:, :-2], position_ids=positions, use_cache=False).last_hidden_state
        assert hidden.shape == fresh.shape == (options.batch, options.seq_len - 1, model.config.hidden_size)
        assert rel_err(hidden, fresh) <= 1e-5
        assert rel_err(frozen_hidden(model, windows, batch=3), fresh) <= 1e-5  # 3 + 1 windows per forward
        with torch.no_grad():
            assert rel_err(head.logits(model, windows, hidden), head.logits(model, windows)) <= 1e-5
    assert not torch.equal(got[0][0], got[1][0]) and not torch.equal(got[1][0], got[2][0])  # across forwards
