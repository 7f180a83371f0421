import pytest
import torch

from hybridcache.sampling import SamplingParams, make_generator, sample


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
    ],
)
def test_bad_sampling_params_raise_naming_the_field(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kwargs)


def test_greedy_takes_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 1.0, 0.0]])
    params = [SamplingParams(temperature=0)] * 2
    assert sample(logits, params, [None, None]) == [1, 0]


def test_seeded_sampling_is_reproducible_and_rows_independent():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    params = SamplingParams(temperature=1.0, seed=7)
    first = sample(logits, [params] * 3, [make_generator(params, i, "cpu") for i in range(3)])
    again = sample(logits, [params] * 3, [make_generator(params, i, "cpu") for i in range(3)])
    assert first == again
    # Row 1 draws the same token whether or not other rows are sampled alongside it.
    alone = sample(logits[1:2], [params], [make_generator(params, 1, "cpu")])
    assert alone == first[1:2]


def test_top_k_one_and_tiny_top_p_are_greedy():
    torch.manual_seed(1)
    logits = torch.randn(4, 100)
    best = logits.argmax(-1).tolist()
    nearly_greedy = (SamplingParams(temperature=1, top_k=1, seed=0), SamplingParams(temperature=1, top_p=1e-6, seed=0))
    for params in nearly_greedy:
        tokens = sample(logits, [params] * 4, [make_generator(params, i, "cpu") for i in range(4)])
        assert tokens == best


def test_top_k_restricts_support():
    logits = torch.tensor([[4.0, 3.9, 3.8, -1.0, -2.0]])
    params = SamplingParams(temperature=5.0, top_k=3, seed=3)
    generator = make_generator(params, 0, "cpu")
    drawn = {sample(logits, [params], [generator])[0] for _ in range(200)}
    assert drawn <= {0, 1, 2} and len(drawn) > 1
