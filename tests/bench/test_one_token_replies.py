"""Replies of one token (max_tokens=1): a completion that hits its whole prompt feeds nothing, yet its step commits
(the restore), as the engine commits every step (`commit_step({})`); the simulator crashed with "finish of ...
with uncommitted restores or saves" (hunt 129)."""

import pytest

from hybridcache.bench.simulator import SimConfig, parse_policies, simulate
from hybridcache.bench.workloads import SimRequest, Workload
from hybridcache.engine.cost_model import ModelCost, load_model_cost

HYBRID = ("hybridcache", "hybridcache+flop", "hybridcache+all", "bounded-oracle")
SMALL_STATE = ModelCost("toy1", kv_bytes_per_token=16, state_bytes=64, flops_per_token=10.0,
                        attn_flops_per_token_pair=1.0)


def _simulate(requests, policies, cost, config):
    requests = tuple(requests)
    return simulate(Workload("toy", len(requests), lambda: iter(requests)), parse_policies(policies, config.block_size),
                    cost, config).policies


PROMPT = tuple(i % 256 for i in range(100))


@pytest.mark.parametrize("policy", HYBRID)
def test_a_resend_with_a_one_token_reply_hits_its_whole_prompt(policy):
    requests = (SimRequest("a", PROMPT, (7, 8, 9)), SimRequest("b", PROMPT, (5,)))
    result = _simulate(requests, policy, load_model_cost(None), SimConfig(1 << 30, 64, check_integrity=True))[policy]
    assert result.hit_tokens == len(PROMPT)  # b restores a's prompt end (or finish checkpoint) and only samples


@pytest.mark.parametrize("outputs", [((0,), (1,)), ((0,), (1, 2, 3), (4,))], ids=["n2-1,1", "n3-1,3,1"])
@pytest.mark.parametrize("policy", ("hybridcache", "bounded-oracle"))
def test_n_completions_of_one_token_share_the_prompt(policy, outputs):
    request = SimRequest("r0", PROMPT, outputs[0], n=len(outputs), sibling_output_ids=outputs[1:])
    result = _simulate([request], policy, load_model_cost(None), SimConfig(1 << 30, 64, check_integrity=True))[policy]
    assert result.prompt_tokens == len(outputs) * len(PROMPT)
    assert result.hit_tokens == (len(outputs) - 1) * len(PROMPT)  # completion 0 prefills, the others hit it all


@pytest.mark.parametrize("policy", ("hybridcache", "bounded-oracle"))
def test_a_completion_admitted_and_finished_in_one_step_unblocks_the_waiting_ones(policy):
    """Fuzz trial 77 of hunt 129, cut down: in a small cache, r5's completions hit the whole prompt and sample
    their one token in the step that admits them; the one left waiting must be admitted after that finish (it hung:
    only completions that were running before the step unblocked admission)."""
    prompt = (1, 1, 1, 0, 2, 3, 1, 1, 0, 2, 0)
    requests = (SimRequest("r4", prompt, (0, 3, 3, 2, 2), n=2, sibling_output_ids=((3, 1, 0),)),
                SimRequest("r5", prompt, (1,), n=2, sibling_output_ids=((0,),)))
    config = SimConfig(600, 8, 3, kv_tokens_per_slot=4, check_integrity=True)
    result = _simulate(requests, policy, SMALL_STATE, config)[policy]
    assert result.num_requests == 2
    assert result.prompt_tokens == 4 * len(prompt)
