"""`LearnedAdmission`: a save reason is admitted while its checkpoints are hit often enough; declined saves
leave ghosts that bring the reason back when they would have been hit."""

from hybridcache.cache import CacheConfig, CacheRequest, PrefixCache, SaveReason
from hybridcache.cache.admission import LearnedAdmission
from tests.cache.fake_engine import Driver

FINISH, BRANCH = SaveReason.FINISH, SaveReason.BRANCH_POINT


def test_a_reason_that_is_never_hit_stops_being_admitted_and_ghosts_bring_it_back():
    learner = LearnedAdmission(capacity=8)
    for _ in range(20):
        learner.used(FINISH, None)
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
    assert learner.kinds[(FINISH, None)].uses == 1
    cache.clear()  # the unhit prefill-end checkpoints are released unhit
    assert learner.kinds[(SaveReason.PREFILL_END, None)].wastes >= 1
    cache.check_integrity()
