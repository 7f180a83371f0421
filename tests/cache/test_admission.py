"""`LearnedAdmission`: a save reason is admitted while its checkpoints save enough prefill tokens per save;
declined saves leave ghosts that bring the reason back when they would have been hit."""

from hybridcache.cache import CacheConfig, CacheRequest, PrefixCache, SaveReason
from hybridcache.cache.admission import LearnedAdmission
from tests.cache.fake_engine import Driver

FINISH, BRANCH = SaveReason.FINISH, SaveReason.BRANCH_POINT


def test_a_reason_that_is_never_hit_stops_being_admitted_and_ghosts_bring_it_back():
    learner = LearnedAdmission(capacity=8)
    for _ in range(20):
        learner.used(FINISH, None, 20)
        learner.wasted(BRANCH, None)
    assert learner.admit(FINISH, None)
    assert not learner.admit(BRANCH, None)
    assert learner.admit(SaveReason.CHUNK_END, None)  # nothing known yet: admitted
    assert learner.admit(BRANCH, "lora")  # per adapter
    prompt = tuple(range(40))
    for i in range(20):  # declined branch points that later prompts would have hit
        learner.declined(BRANCH, None, (None, 1, 1234), 17 + i % 4, prompt[16:17 + i % 4])
        learner.ghost_hit([(None, 1, 1234)], prompt, 16, got=16, max_step=40)
    assert learner.num_ghosts == 0
    assert learner.admit(BRANCH, None)


def test_the_rule_weighs_tokens_saved_not_hits():
    """The module docstring's example: finish checkpoints hit rarely but deep (4 of 100, 2,000 tokens each) pay;
    branch points hit often but shallow (90 of 100, 16 tokens each) do not. Counting hits alone would decide
    the other way round."""
    learner = LearnedAdmission()
    for i in range(100):
        if i < 4:
            learner.used(FINISH, None, 2000)
        else:
            learner.wasted(FINISH, None)
        if i < 90:
            learner.used(BRANCH, None, 16)
        else:
            learner.wasted(BRANCH, None)
    assert learner.overall.mean() == (4 * 2000 + 90 * 16) / 200
    assert learner.kinds[(FINISH, None)].value(47.2) == (8000 + 2 * 47.2) / 102  # 79.4 >= 23.6
    assert learner.admit(FINISH, None)
    assert not learner.admit(BRANCH, None)  # (1,440 + 94.4) / 102 = 15.0 < 23.6


def test_a_kind_worth_its_bytes_in_kv_is_admitted_whatever_the_others_do():
    """cheap_tokens (k x B with paged states): a kind that saves at least the tokens of KV its pages would hold
    is admitted even below share x the mean (a built-in model's state is 2 blocks of 64 tokens: 128)."""
    learner = LearnedAdmission(cheap_tokens=128)
    for _ in range(50):
        learner.used(FINISH, None, 4000)
        learner.used(BRANCH, None, 300)
        learner.wasted(BRANCH, None)
    mean = learner.overall.mean()  # (200,000 + 15,000) / 150 = 1,433
    assert learner.kinds[(BRANCH, None)].value(mean) < learner.share * mean
    assert learner.admit(BRANCH, None)  # (15,000 + 2,867) / 102 = 175 >= 128
    learner.cheap_tokens = 200
    assert not learner.admit(BRANCH, None)


def test_ghosts_beyond_capacity_count_as_wasted():
    learner = LearnedAdmission(capacity=2)
    for i in range(3):
        learner.declined(BRANCH, None, (None, 0, 0), i + 1, tuple(range(i + 1)))
    assert learner.num_ghosts == 2
    assert learner.kinds[(BRANCH, None)].wastes == 1


def test_the_cache_learns_from_hits_and_evictions():
    cache = PrefixCache(CacheConfig(block_size=4, num_blocks=64, num_slots=4, admission="learned"))
    driver = Driver(cache)
    driver.run(CacheRequest("a", tuple(range(10))), decode=[7])  # prefill end at 10, finish at 11
    hit = driver.run(CacheRequest("b", tuple(range(10)) + (7, 8, 9)))  # hits the finish checkpoint
    assert hit.cached_len == 11
    learner = cache._learner
    assert (learner.kinds[(FINISH, None)].uses, learner.kinds[(FINISH, None)].tokens) == (1, 11)
    cache.clear()  # the unhit prefill-end checkpoints are released unhit
    assert learner.kinds[(SaveReason.PREFILL_END, None)].wastes >= 1
    cache.check_integrity()


def test_a_save_that_fits_in_free_memory_is_always_made():
    """The learner decides only when a save would displace something: with k + 1 free blocks a kind it declines
    is still saved; once the pool is nearly full (another sequence holds it) the same kind is declined."""
    from hybridcache.cache.admission import Outcomes
    from tests.cache.conftest import make_driver, tokens

    driver = make_driver(block_size=4, num_blocks=16, num_slots=2, state_pages=2, admission="learned")
    cache = driver.cache
    learner = cache._learner
    learner.overall = Outcomes(uses=10, wastes=10, tokens=1000)
    for reason in (SaveReason.CHUNK_END, SaveReason.PREFILL_END):
        learner.kinds[(reason, None)] = Outcomes(wastes=100)
        assert not learner.admit(reason, None)
    prompt = tokens(10, seed=1)
    driver.admit(CacheRequest("a", prompt))
    driver.step("a", prompt[:6], [("chunk_end",)])  # 2 blocks, then 2 pages + a frozen block: 14 were free
    assert cache.stats.saves_by_reason["chunk_end"] == 1 and cache.stats.num_blocks_used == 5
    other = tokens(36, seed=2)
    driver.admit(CacheRequest("b", other))
    driver.step("b", other)  # 9 blocks: 2 left, and a's next step takes one of them
    driver.step("a", prompt[6:], [("prefill_end",)])
    assert "prefill_end" not in cache.stats.saves_by_reason
    assert cache.stats.declined_saves == {"policy": 1}
