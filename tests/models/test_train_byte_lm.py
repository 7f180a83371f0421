"""benchmarks/train_byte_lm.py: a few training steps lower the held-out loss (the model's, then its MTP head's), and
the folder it writes loads in `LLM` with the logits transformers computes on the same folder (the bf16 agreement
measurement runs on it) and the trained MTP head in the MTP loader."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from benchmarks.train_byte_lm import CORPUS_FILE, RECORD_FILE, TrainOptions, train
from hybridcache import LLM
from hybridcache.models import load_model
from hybridcache.models.mtp import MTP_FILE, load_mtp_head
from hybridcache.sampling import SamplingParams, top_logprobs
from tests.engine.model_folders import load_hf_model

from .helpers import rel_err

PROMPT_LEN = 200
# The first 60,000 bytes of this repository's README.md and docs/*.md as they once were: the checkout's would change
# with every documentation edit (what 8 steps can learn; which windows a test draws, and their rounding)
FROZEN_CORPUS = Path(__file__).parent / "data" / "byte_lm_corpus.txt"


def test_training_lowers_the_loss_and_the_folder_matches_transformers(tmp_path):
    # A frozen corpus (the first 60,000 bytes of this repository's README.md and docs/*.md as they once were), not
    # the checkout's: a documentation edit changes what 8 steps can learn, and with it the loss this test bounds.
    corpus = FROZEN_CORPUS.read_bytes()
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
    first = top_logprobs(output.outputs[0].logprobs[0], output.outputs[0].token_ids[0], 20)
    top = want[-1].topk(20)
    assert [token for token, _ in first] == top.indices.tolist()
    assert rel_err(torch.tensor([lp.logprob for _, lp in first]), top.values) <= 1e-4
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
    train_bytes, _ = split(FROZEN_CORPUS.read_bytes()[:40_000])  # (the checkout's docs would move the windows)
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


def test_the_unrolled_head_drafts_position_two_as_the_engine_does():
    """`MtpTrainer.unrolled_logits`: position 1 is `logits`; position 2 at row t equals the head run by hand as the
    engine drafts, over pass 1's rows 0 .. t and then one row at position t + 1 (byte t + 2, pass 1's output at t)
    under a plain causal mask; `unrolled`'s losses and accuracies follow from them."""
    import torch.nn.functional as F
    import transformers

    from benchmarks.train_byte_lm import MtpTrainer
    from hybridcache.models.random_weights import randomize_
    from tests.engine.model_folders import HF_CLASSES, byte_config

    model = getattr(transformers, HF_CLASSES["qwen3_next"])(byte_config("qwen3_next")).eval().requires_grad_(False)
    randomize_(model, seed=5)
    head = MtpTrainer(model).eval()
    randomize_(head, seed=6)
    windows = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        first, second = head.unrolled_logits(model, windows)
        assert first.shape == (2, 38, model.config.vocab_size) and second.shape == (2, 37, model.config.vocab_size)
        assert rel_err(first, head.logits(model, windows)) <= 1e-5
        hidden = frozen_hidden_of(model, windows)
        x = head.fc(torch.cat([head.pre_fc_norm_embedding(model.model.embed_tokens(windows[:, 1:-1])),
                               head.pre_fc_norm_hidden(hidden)], dim=-1))
        out1 = head.norm(head.layers[0](x, position_embeddings=model.model.rotary_emb(x, _positions(38)),
                                        attention_mask=None, position_ids=_positions(38)))
        for t in (0, 7, 36):
            y = head.fc(torch.cat([head.pre_fc_norm_embedding(model.model.embed_tokens(windows[:, t + 2: t + 3])),
                                   head.pre_fc_norm_hidden(out1[:, t: t + 1])], dim=-1))
            seq, at = torch.cat([x[:, : t + 1], y], dim=1), torch.cat([_positions(t + 1), _positions(1) + t + 1], 1)
            mask = head._create_causal_mask(**head._mask_arguments(seq, at))
            out = head.layers[0](seq, position_embeddings=model.model.rotary_emb(seq, at), attention_mask=mask,
                                 position_ids=at)
            by_hand = model.lm_head(head.norm(out[:, -1])).float()
            assert rel_err(second[:, t], by_hand) <= 1e-5, t
        loss1, loss2, right1, right2 = head.unrolled(model, windows)
    assert abs(loss1.item() - F.cross_entropy(first.reshape(-1, first.shape[-1]), windows[:, 2:].reshape(-1))) < 1e-5
    assert abs(loss2.item() - F.cross_entropy(second.reshape(-1, second.shape[-1]), windows[:, 3:].reshape(-1))) < 1e-5
    hits = first.argmax(-1) == windows[:, 2:]
    assert right1.item() == hits.float().mean().item()
    both = (second.argmax(-1) == windows[:, 3:]) & hits[:, :-1]
    assert right2.item() == both.sum().item() / max(1, hits[:, :-1].sum().item())


def _positions(count: int) -> torch.Tensor:
    return torch.arange(count).expand(2, -1)


def frozen_hidden_of(model, windows: torch.Tensor) -> torch.Tensor:
    return model.model(input_ids=windows[:, :-2], position_ids=_positions(windows.shape[1] - 2),
                       use_cache=False).last_hidden_state
