"""`oracle`'s bytes_peak is the KV of every distinct fed token: `OracleIndex.num_tokens` counts each distinct fed
prefix once (it counted a partial tail again when a later sequence extended it to a full block, and two tails
sharing their first tokens twice; hunt 129)."""

import random

import pytest

from hybridcache.bench.oracles import OracleIndex


def _distinct_prefixes(sequences) -> int:
    """The reference: nodes of a token-level trie of `sequences`."""
    root, count = {}, 0
    for tokens in sequences:
        node = root
        for token in tokens:
            if token not in node:
                node[token] = {}
                count += 1
            node = node[token]
    return count


@pytest.mark.parametrize(("sequences", "expected"), [
    ([(1, 2), (1, 2, 3, 4, 5)], 5),  # a tail, then a block that extends it
    ([(1, 2, 3), (1, 2, 7)], 4),  # two tails sharing their first two tokens
    ([(1, 2, 3, 4, 5, 6), (1, 2, 3, 4, 5, 7), (1, 2, 3, 4, 5)], 7),  # tails under a shared block
    ([(1, 2, 3, 4), (1, 2, 3, 4)], 4),  # a block fed twice
], ids=["tail-then-block", "tails-sharing-a-prefix", "tails-under-a-block", "block-twice"])
def test_num_tokens_counts_each_distinct_prefix_once(sequences, expected):
    index = OracleIndex(block_size=4)
    for tokens in sequences:
        index.insert(tokens)
    assert index.num_tokens == _distinct_prefixes(sequences) == expected


@pytest.mark.parametrize("seed", range(20))
def test_num_tokens_matches_a_token_trie_on_random_sequences(seed):
    rng = random.Random(seed)
    index, fed = OracleIndex(block_size=rng.choice([2, 3, 4])), []
    for _ in range(30):
        base = rng.choice(fed) if fed and rng.random() < 0.7 else ()
        tokens = base[: rng.randint(0, len(base))] + tuple(rng.randrange(3) for _ in range(rng.randint(1, 9)))
        index.insert(tokens)
        fed.append(tokens)
        assert index.num_tokens == _distinct_prefixes(fed)
        assert index.longest_prefix(tokens) == len(tokens)
