import pytest
import torch

from hybridcache.sampling import SamplingParams, filtered_probs, make_generator, process_logits
from hybridcache.sampling import sample as sample_rows

# Every sampler test runs on the CPU and, where there is one, on a CUDA device (the sampler runs there in a GPU
# engine); the CUDA variants skip cleanly without CUDA.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                reason="needs a CUDA device"))]


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


class Row:
    """A sequence as the sampler sees it (the engine passes its `Seq`s)."""

    def __init__(self, params, generator=None, prompt=(0,), output=()):
        self.params, self.generator = params, generator
        self.token_ids, self.prompt_len = [*prompt, *output], len(prompt)


def sample(logits, params, generators):
    return sample_rows(logits, [Row(p, g) for p, g in zip(params, generators)]).tokens


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n must"),
        ({"seed": 1.5}, "seed"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop": [""]}, "stop"),
        ({"output_kind": 1}, "output_kind must be a RequestOutputKind"),
    ],
)
def test_bad_sampling_params_raise_naming_the_field(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kwargs)


def test_greedy_takes_argmax(device):
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 1.0, 0.0]]).to(device)
    params = [SamplingParams(temperature=0)] * 2
    assert sample(logits, params, [None, None]) == [1, 0]


def test_seeded_sampling_is_reproducible_and_rows_independent(device):
    torch.manual_seed(0)
    logits = torch.randn(3, 50).to(device)
    params = SamplingParams(temperature=1.0, seed=7)
    first = sample(logits, [params] * 3, [make_generator(params, i, device) for i in range(3)])
    again = sample(logits, [params] * 3, [make_generator(params, i, device) for i in range(3)])
    assert first == again
    # Row 1 draws the same token whether or not other rows are sampled alongside it.
    alone = sample(logits[1:2], [params], [make_generator(params, 1, device)])
    assert alone == first[1:2]


def test_top_k_one_and_tiny_top_p_are_greedy(device):
    torch.manual_seed(1)
    logits = torch.randn(4, 100).to(device)
    best = logits.argmax(-1).tolist()
    nearly_greedy = (SamplingParams(temperature=1, top_k=1, seed=0), SamplingParams(temperature=1, top_p=1e-6, seed=0))
    for params in nearly_greedy:
        tokens = sample(logits, [params] * 4, [make_generator(params, i, device) for i in range(4)])
        assert tokens == best


def test_top_k_restricts_support(device):
    logits = torch.tensor([[4.0, 3.9, 3.8, -1.0, -2.0]]).to(device)
    params = SamplingParams(temperature=5.0, top_k=3, seed=3)
    generator = make_generator(params, 0, device)
    drawn = {sample(logits, [params], [generator])[0] for _ in range(200)}
    assert drawn <= {0, 1, 2} and len(drawn) > 1


def test_top_k_keeps_the_tokens_tied_with_the_kth_score_as_vllm_and_transformers(device):
    from transformers.generation.logits_process import TopKLogitsWarper

    scores = torch.tensor([[3.0, 2.0, 2.0, 1.0, 0.5], [1.0, 1.0, 1.0, 1.0, 0.0]])
    params = [SamplingParams(temperature=1, top_k=2), SamplingParams(temperature=1, top_k=1)]
    got = filtered_probs(scores.to(device), params).cpu()
    expected = torch.stack([torch.softmax(TopKLogitsWarper(k)(None, row[None]), -1)[0]
                            for k, row in zip((2, 1), scores)])
    torch.testing.assert_close(got, expected)
    assert got[0, 2] > 0 and got[1, :4].tolist() == [0.25] * 4
    # a top_k above the vocabulary keeps everything
    wide = filtered_probs(scores.to(device), [SamplingParams(temperature=1, top_k=1000)] * 2).cpu()
    torch.testing.assert_close(wide, torch.softmax(scores, -1))


def test_penalties_follow_vllm_formulas_exactly(device):
    torch.manual_seed(2)
    logits = torch.randn(3, 12)
    prompt, output = (0, 3, 3), (1, 1, 5, 3)
    cases = [
        SamplingParams(temperature=0, repetition_penalty=1.7),
        SamplingParams(temperature=0, frequency_penalty=0.6, presence_penalty=-0.3),
        SamplingParams(temperature=0, repetition_penalty=0.5, frequency_penalty=-1.0, presence_penalty=2.0),
    ]
    rows = [Row(p, prompt=prompt, output=output) for p in cases]
    got = process_logits(logits.to(device), rows).cpu()
    counts = torch.zeros(12)
    for t in output:
        counts[t] += 1
    seen = counts > 0
    seen[list(prompt)] = True
    for i, p in enumerate(cases):
        expected = logits[i].clone()
        r = p.repetition_penalty
        expected[seen] = torch.where(expected[seen] > 0, expected[seen] / r, expected[seen] * r)
        expected -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        torch.testing.assert_close(got[i], expected, rtol=0, atol=1e-6)


def test_penalty_worked_example_from_docstring(device):
    logits = torch.tensor([[2.0, -1.0, 0.5]])
    params = SamplingParams(temperature=0, repetition_penalty=2, frequency_penalty=0.5, presence_penalty=0.25)
    got = process_logits(logits.to(device), [Row(params, prompt=(0,), output=(1, 1))])
    assert got.tolist() == [[1.0, -3.25, 0.5]]


def test_unpenalized_rows_in_a_penalized_batch_are_untouched(device):
    torch.manual_seed(3)
    logits = torch.randn(2, 10).to(device)
    rows = [Row(SamplingParams(temperature=0), output=(1, 2)),
            Row(SamplingParams(temperature=0, presence_penalty=1.0), output=(1, 2))]
    got = process_logits(logits, rows)
    assert torch.equal(got[0], logits[0])
    assert not torch.equal(got[1], logits[1])


def test_logit_bias_and_min_tokens(device):
    logits = torch.zeros(2, 6).to(device)
    biased = SamplingParams(temperature=0, logit_bias={4: 100.0, 2: -5.0})
    short = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3])
    got = process_logits(logits, [Row(biased), Row(short, output=(1,))], stop_token_ids=frozenset({5}))
    assert got[0].tolist() == [0, 0, -5, 0, 100, 0]
    assert got[1, 3] == float("-inf") and got[1, 5] == float("-inf") and got[1, :3].eq(0).all()
    done = process_logits(logits, [Row(short, output=(1, 2))], stop_token_ids=frozenset({5}))
    assert done.eq(0).all()
    out = sample_rows(logits[:1], [Row(biased)])
    assert out.tokens == [4]


def test_allowed_bitmask_restricts_tokens(device):
    torch.manual_seed(4)
    logits = torch.randn(2, 40).to(device)
    mask = torch.zeros(2, 2, dtype=torch.int32)
    mask[0, 1] = 1 << 3  # token 35 only
    mask[1, 0] = (1 << 2) | (1 << 7)  # tokens 2 and 7
    params = SamplingParams(temperature=1.0, seed=0)
    for _ in range(20):
        rows = [Row(params, make_generator(params, i, device)) for i in range(2)]
        tokens = sample_rows(logits, rows, allowed_bitmask=mask.to(device)).tokens
        assert tokens[0] == 35 and tokens[1] in (2, 7)


def test_min_p_drops_unlikely_tokens(device):
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).to(device)
    params = SamplingParams(temperature=1.0, min_p=0.2, seed=0)
    generator = make_generator(params, 0, device)
    drawn = {sample_rows(logits, [Row(params, generator)]).tokens[0] for _ in range(300)}
    assert drawn == {0, 1, 2}


def test_logprobs_are_log_softmax_of_the_fp32_logits(device):
    torch.manual_seed(5)
    logits = torch.randn(3, 50).to(device)
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0.8, seed=1, logprobs=0),
              SamplingParams(temperature=0)]
    rows = [Row(p, make_generator(p, 0, device), output=(1, 1)) for p in params]
    out = sample_rows(logits, rows)
    expected = torch.log_softmax(logits.float(), dim=-1).cpu()
    first, second, third = out.logprobs
    assert third is None
    assert first.token_id == out.tokens[0] == int(logits[0].argmax())
    assert first.logprob == pytest.approx(float(expected[0, out.tokens[0]]), abs=1e-6)
    top = expected[0].topk(3)
    assert [t for t, _ in first.top] == top.indices.tolist()
    assert [v for _, v in first.top] == pytest.approx(top.values.tolist(), abs=1e-6)
    assert second.logprob == pytest.approx(float(expected[1, out.tokens[1]]), abs=1e-6) and second.top == ()


def test_batched_rows_match_rows_sampled_alone(device):
    torch.manual_seed(6)
    logits = torch.randn(4, 64).to(device)
    params = [SamplingParams(temperature=0.7, top_k=10, seed=1), SamplingParams(temperature=0),
              SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05, seed=2), SamplingParams(temperature=1.0, seed=3)]
    batch = sample_rows(logits, [Row(p, make_generator(p, 0, device)) for p in params]).tokens
    alone = [sample_rows(logits[i:i + 1], [Row(p, make_generator(p, 0, device))]).tokens[0]
             for i, p in enumerate(params)]
    assert batch == alone


@pytest.mark.parametrize("kwargs, needle", [
    ({"presence_penalty": 3}, "presence_penalty"), ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"), ({"min_tokens": -1}, "min_tokens"),
    ({"logit_bias": {3: 101}}, "logit_bias"), ({"logprobs": 21}, "logprobs"),
    ({"min_tokens": 5, "max_tokens": 4}, "^min_tokens must be at most max_tokens"),
])
def test_bad_new_sampling_params_raise(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, error, needle", [
    # each of these passed validation and then failed inside a step (which kills the engine for every request)
    ({"logprobs": True}, ValueError, "logprobs"), ({"logit_bias": {True: 5.0}}, ValueError, "logit_bias"),
    ({"stop_token_ids": [True]}, ValueError, "stop_token_ids"), ({"top_k": 2**63}, ValueError, "top_k"),
    # or sampled token 0 from rows of NaN (inf / inf)
    ({"temperature": float("inf")}, ValueError, "temperature"),
    ({"repetition_penalty": float("inf")}, ValueError, "repetition_penalty"),
    # or were taken as something else
    ({"n": True}, ValueError, "n must"), ({"max_tokens": True}, ValueError, "max_tokens"),
    ({"seed": True}, ValueError, "seed"), ({"top_p": True}, ValueError, "top_p"),
    ({"ignore_eos": "no"}, ValueError, "ignore_eos"), ({"skip_special_tokens": None}, ValueError, "skip_special"),
    ({"include_stop_str_in_output": 1}, ValueError, "include_stop_str_in_output"),
    ({"logit_bias": [1, 2]}, TypeError, "logit_bias"), ({"logit_bias": 5}, TypeError, "logit_bias"),
    ({"guided": "regex"}, TypeError, "guided"), ({"guided": {"kind": "regex"}}, TypeError, "guided"),
])
def test_values_that_broke_a_step_are_refused_naming_the_field(kwargs, error, needle):
    with pytest.raises(error, match=needle):
        SamplingParams(**kwargs)


def test_numbers_are_stored_as_floats():
    """An int temperature or penalty too large for int64 (10**19) reaches the sampler's fp32 tensors as a float."""
    params = SamplingParams(temperature=10**19, repetition_penalty=10**19, logit_bias={3: 2})
    assert (params.temperature, params.repetition_penalty, params.logit_bias) == (1e19, 1e19, ((3, 2.0),))
    assert all(type(v) is float for v in (params.temperature, params.repetition_penalty, params.logit_bias[0][1]))


def test_numpy_scalars_are_taken_as_the_python_numbers_they_hold():
    """vLLM's SamplingParams takes numpy scalars (a seed drawn with numpy, a temperature from an np.linspace);
    they are stored as Python ints and floats, and a numpy float where an integer belongs is still refused."""
    np = pytest.importorskip("numpy")
    params = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), seed=np.int64(7), max_tokens=np.int32(5),
                            n=np.int64(2), logprobs=np.int64(1), stop_token_ids=[np.int64(2)],
                            logit_bias={np.int64(3): np.float32(1.5)})
    assert (params.temperature, params.top_k, params.seed, params.max_tokens, params.n, params.logprobs) == (
        0.5, 3, 7, 5, 2, 1)
    assert params.stop_token_ids == (2,) and params.logit_bias == ((3, 1.5),)
    assert all(type(v) is int for v in (params.top_k, params.seed, params.max_tokens, params.stop_token_ids[0],
                                        params.logit_bias[0][0]))
    assert SamplingParams(seed=np.int64(-1)).seed is None  # vLLM's "no seed"
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=np.float64(3.0))
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=np.bool_(True))


def test_tiny_temperatures_sample_greedily_instead_of_overflowing(device):
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, -1.0, 0.5]]).to(device)
    for temperature in (5.9e-109, 1e-6):
        params = SamplingParams(temperature=temperature, seed=0)
        assert params.greedy
        assert list(sample(logits, [params, params], [torch.Generator(device).manual_seed(0)] * 2)) == [1, 0]
    assert not SamplingParams(temperature=1e-4).greedy


def test_all_greedy_batches_take_the_raw_argmax_unless_a_row_changes_its_scores(device):
    """An all-greedy batch with nothing to process takes `argmax` of the logits as they are (the engine passes
    `kernels.sampling.greedy_tokens`: on CUDA the Triton argmax): torch's first-of-equal-values rule on a vocabulary
    with many ties. A row whose stop token is masked by min_tokens, or that is penalised, still goes through
    `process_logits`."""
    from hybridcache.kernels.sampling import greedy_tokens

    gen = torch.Generator().manual_seed(8)
    logits = ((torch.randn(9, 3001, generator=gen) * 2).round() / 2).to(device)
    logits[0, 17] = logits[0, 2999] = logits[0].max() + 1
    plain = SamplingParams(temperature=0)

    def tokens(rows, **options):
        return sample_rows(logits, rows, argmax=greedy_tokens, **options).tokens

    out = sample_rows(logits, [Row(plain, output=(1,)) for _ in range(9)], argmax=greedy_tokens)
    assert out.tokens == logits.cpu().argmax(dim=-1).tolist() and out.tokens[0] == 17
    assert sample_rows(logits, [Row(plain)] * 9).tokens == out.tokens  # the sampler's own argmax: the same
    with_logprobs = sample_rows(logits, [Row(SamplingParams(temperature=0, logprobs=1))] + [Row(plain)] * 8,
                                argmax=greedy_tokens)
    assert with_logprobs.tokens == out.tokens and with_logprobs.logprobs[0].token_id == 17
    short = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[17])
    assert tokens([Row(short, output=(1,))] + [Row(plain)] * 8)[0] != 17
    assert tokens([Row(short, output=(1, 2, 3))] + [Row(plain)] * 8)[0] == 17  # min_tokens reached
    eos_short = SamplingParams(temperature=0, min_tokens=3)
    assert tokens([Row(eos_short)] + [Row(plain)] * 8, stop_token_ids=frozenset({17}))[0] != 17
    penalised = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert tokens([Row(penalised, output=(17,))] + [Row(plain)] * 8)[0] != 17


# ------------------------------------------------------------------- vLLM's rules found missing by a bug hunt


def test_seed_minus_one_means_no_seed_as_in_vllm(device):
    """vLLM turns seed -1 into None (clients send -1 for "random"); before, -1 seeded every such request alike."""
    params = SamplingParams(temperature=1.0, seed=-1)
    assert params.seed is None
    logits = torch.zeros(1, 1000).to(device)
    draws = [tuple(sample_rows(logits, [Row(params, make_generator(params, 0, device))]).tokens for _ in range(8))
             for _ in range(2)]
    assert draws[0] != draws[1]


def test_min_tokens_bans_eos_under_ignore_eos_as_in_vllm(device):
    """vLLM's min_tokens masks all_stop_token_ids, which hold the model's EOS even with ignore_eos: EOS cannot come
    before min_tokens. Before, ignore_eos left EOS open there."""
    logits = torch.zeros(1, 6).to(device)
    params = SamplingParams(temperature=0, min_tokens=3, ignore_eos=True, logit_bias={5: 100.0})
    short = process_logits(logits, [Row(params, output=(1,))], stop_token_ids=frozenset({5}))
    assert short[0, 5] == float("-inf")
    assert sample_rows(logits, [Row(params, output=(1,))], stop_token_ids=frozenset({5})).tokens != [5]
    long_enough = process_logits(logits, [Row(params, output=(1, 2, 3))], stop_token_ids=frozenset({5}))
    assert long_enough[0, 5] == 100.0


def test_logprobs_of_a_guided_row_see_the_grammars_mask_as_in_vllm(device):
    """vLLM applies the grammar's bitmask to the logits before its sampler computes logprobs: the sampled token's
    logprob is over the allowed tokens alone, and forbidden tokens are -inf. Before, they were the unmasked
    distribution's (a token the grammar forced reported at rank 100)."""
    torch.manual_seed(7)
    logits = torch.randn(1, 40).to(device)
    mask = torch.zeros(1, 2, dtype=torch.int32)
    mask[0, 0] = (1 << 2) | (1 << 7)  # tokens 2 and 7
    out = sample_rows(logits, [Row(SamplingParams(temperature=0, logprobs=3))], allowed_bitmask=mask.to(device))
    allowed = torch.log_softmax(logits[0, [2, 7]].float(), dim=-1).cpu()
    entry = out.logprobs[0]
    token = out.tokens[0]
    assert token == (2 if allowed[0] > allowed[1] else 7)
    assert entry.logprob == pytest.approx(float(allowed.max()), abs=1e-6) and entry.rank == 1
    assert [t for t, _ in entry.top[:2]] == ([2, 7] if token == 2 else [7, 2])
    assert entry.top[2][1] == float("-inf")


def test_a_tied_token_takes_the_worse_rank_as_in_vllm(device):
    """vLLM's rank counts the tokens whose logprob is at least the token's own (`batched_count_greater_than`): a
    greedy token tied with another is rank 2, in the sampler, the prompt logprobs and the speculative judge."""
    from hybridcache.engine.speculative import _logprobs
    from hybridcache.sampling import prompt_logprobs

    logits = torch.tensor([[3.0, 3.0, 1.0, 0.0]]).to(device)
    out = sample_rows(logits, [Row(SamplingParams(temperature=0, logprobs=0))])
    assert out.tokens == [0] and out.logprobs[0].rank == 2
    assert prompt_logprobs(logits, torch.tensor([1]).to(device), 1)[0][1].rank == 2
    assert _logprobs(logits, (0,), 1)[0].rank == 2
    assert sample_rows(torch.tensor([[3.0, 2.0]]).to(device),
                       [Row(SamplingParams(temperature=0, logprobs=0))]).logprobs[0].rank == 1


@pytest.mark.parametrize("kwargs", [dict(top_p=0.6), dict(top_k=2), dict(min_p=0.3), dict(top_k=3, top_p=0.5)])
def test_filtered_probabilities_sum_to_one(device, kwargs):
    """The speculative judge accepts a draft with its probability under `filtered_probs`; before, a top-p cut left
    the rows unnormalised (summing to about top_p)."""
    from hybridcache.sampling import filtered_probs

    torch.manual_seed(8)
    scores = torch.randn(3, 30).to(device)
    probs = filtered_probs(scores, [SamplingParams(temperature=0.9, **kwargs)] * 3)
    assert torch.allclose(probs.sum(dim=-1), torch.ones(3, device=device), atol=1e-5)
