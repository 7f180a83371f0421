"""What a failure in the middle of a step leaves behind (hunt 135): an interrupt anywhere in the scheduler's plan
leaves the engine failed, not running on with a cache that indexes what the device never wrote; `LLM.generate`
holds a Ctrl-C until the step in progress ends, so that it leaves the engine usable; a plan's error with a step in
flight comes back at the next call; `close()` shuts the executor down even when the hand-off to disk fails; a
progress bar that fails to build queues nothing. (The failed forward itself: test_engine.py.)"""

from __future__ import annotations

import signal
import threading

import pytest

from hybridcache import LLM, SamplingParams
from hybridcache.engine.engine import EngineDeadError

from .model_folders import prompts_of, write_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SCHEDULING = [pytest.param(False, id="sync"), pytest.param(True, id="async")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("qwen3_5_text"), "qwen3_5_text")


def small_llm(model_dir, **options) -> LLM:
    defaults = dict(block_size=16, kernel_block_size=8, max_num_batched_tokens=64, max_num_seqs=4)
    return LLM(model_dir, **{**defaults, **options})


@pytest.fixture(scope="module")
def fresh(model_dir):
    """The greedy tokens of a 150-token prompt on a fresh engine (it takes 3 prefill steps of 64 tokens)."""
    prompt = prompts_of([150], seed=3)[0]
    return prompt, small_llm(model_dir).generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def _interrupt_after(target: object, name: str, monkeypatch) -> None:
    """`target.name` raises KeyboardInterrupt right after its first call returns (a Ctrl-C landing there)."""
    original = getattr(target, name)
    calls = []

    def then_interrupt(*args, **kwargs):
        result = original(*args, **kwargs)
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return result

    monkeypatch.setattr(target, name, then_interrupt)


@pytest.mark.parametrize("async_scheduling", SCHEDULING)
@pytest.mark.parametrize("where", ["commit_step", "admit", "schedule"])
def test_an_interrupt_inside_the_plan_leaves_the_engine_failed(model_dir, fresh, where, async_scheduling,
                                                               monkeypatch):
    """A KeyboardInterrupt after the cache committed the step (inside `Scheduler.schedule`, or right after it
    returned, before the launch) or after the cache admitted a sequence (before the scheduler runs it). Before, with
    no step in flight the engine took it for 'nothing changed' and went on: the committed blocks were never written
    (the same prompt then gave other greedy tokens, check_integrity passing), or the admitted sequence's slot and
    blocks leaked (integrity errors; after max_num_seqs of them nothing could be scheduled)."""
    prompt, _ = fresh
    llm = small_llm(model_dir, async_scheduling=async_scheduling)
    scheduler = llm.engine.scheduler
    _interrupt_after(scheduler if where == "schedule" else scheduler.cache, where, monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([prompt], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # generate aborted its request
    for call in (llm.engine.step, llm.engine.check_integrity, lambda: llm.generate([prompt], GREEDY, use_tqdm=False)):
        with pytest.raises(EngineDeadError, match="KeyboardInterrupt"):
            call()


def _sigint_in_forward(llm: LLM, monkeypatch, times: int = 1) -> list[int]:
    """The first forward sends this process `times` SIGINTs (a Ctrl-C in the middle of a step, as a terminal
    sends it); returns the list the forward calls are counted in."""
    runner = llm.engine.runner
    original = runner.execute
    calls: list[int] = []

    def execute(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            for _ in range(times):
                signal.raise_signal(signal.SIGINT)  # (its handler runs at the next bytecode: inside this step)
        return original(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", execute)
    return calls


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals: main thread only")
@pytest.mark.parametrize("async_scheduling", SCHEDULING)
def test_ctrl_c_during_generate_is_raised_between_steps_and_leaves_the_engine_usable(model_dir, fresh,
                                                                                     async_scheduling, monkeypatch):
    """A real SIGINT in the middle of a step: before, KeyboardInterrupt was raised inside the step (nearly always
    after its commit: of 148 real Ctrl-Cs in hunt 135, 144 killed the engine and 2 left it inconsistent or giving
    wrong tokens). Now generate raises it once the step has ended, aborts its request, and the engine goes on with
    the tokens of a fresh engine; Python's handler is back afterwards."""
    prompt, tokens = fresh
    llm = small_llm(model_dir, async_scheduling=async_scheduling)
    calls = _sigint_in_forward(llm, monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([prompt], GREEDY, use_tqdm=False)
    assert len(calls) == 1  # raised after the first step, not at the end of the request
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_integrity()
    again = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == tokens


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals: main thread only")
def test_a_second_ctrl_c_inside_a_step_is_raised_at_once(model_dir, fresh, monkeypatch):
    """A step that does not end (a hang) can still be stopped: a second Ctrl-C while the first is held is raised
    where it lands, inside the step, which leaves the engine failed (not inconsistent)."""
    prompt, _ = fresh
    llm = small_llm(model_dir)
    _sigint_in_forward(llm, monkeypatch, times=2)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([prompt], GREEDY, use_tqdm=False)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(EngineDeadError, match="KeyboardInterrupt"):
        llm.engine.check_integrity()


def test_generate_off_the_main_thread_leaves_signals_alone(model_dir, fresh):
    """Signal handlers belong to the main thread: generate elsewhere runs as before (nothing is held)."""
    prompt, tokens = fresh
    llm = small_llm(model_dir)
    seen: list = []
    thread = threading.Thread(target=lambda: seen.append(llm.generate([prompt], GREEDY, use_tqdm=False)))
    thread.start()
    thread.join()
    assert seen[0][0].outputs[0].token_ids == tokens


def _plan_fails_once(llm: LLM, monkeypatch, on_call: int) -> None:
    """The scheduler's `on_call`-th plan raises (before changing anything)."""
    scheduler = llm.engine.scheduler
    original = scheduler.schedule
    calls = []

    def schedule():
        calls.append(1)
        if len(calls) == on_call:
            raise RuntimeError("injected: the plan failed")
        return original()

    monkeypatch.setattr(scheduler, "schedule", schedule)


def test_a_plan_error_with_a_step_in_flight_comes_back_at_the_next_call(model_dir, monkeypatch):
    """Async scheduling: when the plan raises while the step before is in flight, the call still postprocesses
    that step and returns its outputs; the error used to be dropped there (nothing raised or logged: in hunt 135 a
    failed disk promotion went unseen). It is raised by the next call, and the engine stays usable."""
    prompts = prompts_of([40, 60], seed=5)
    reference = [o.outputs[0].token_ids for o in small_llm(model_dir).generate(prompts, GREEDY, use_tqdm=False)]
    llm = small_llm(model_dir, async_scheduling=True)
    engine = llm.engine
    engine.add_request("a", prompts[0], GREEDY)  # streamed: every step has an output
    engine.step()
    engine.step()
    _plan_fails_once(llm, monkeypatch, on_call=1)
    assert [o.request_id for o in engine.step()] == ["a"]  # the step before, postprocessed
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    finals = {}
    engine.add_request("b", prompts[1], GREEDY)
    while engine.has_unfinished_requests():
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    assert [finals[r].outputs[0].token_ids for r in ("a", "b")] == reference
    engine.check_integrity()


def test_a_plan_error_with_nothing_to_return_is_raised_at_once_and_dropped_with_its_requests(model_dir, monkeypatch):
    """With no output to hand back first the plan's error is raised by the call itself (`LLM.generate`'s requests
    are final-only); one held for the next call is dropped when every request is aborted before it."""
    prompt = prompts_of([40], seed=5)[0]
    llm = small_llm(model_dir, async_scheduling=True)
    _plan_fails_once(llm, monkeypatch, on_call=2)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate([prompt], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    engine = llm.engine
    engine.add_request("a", prompt, GREEDY)
    engine.step()
    _plan_fails_once(llm, monkeypatch, on_call=1)
    assert engine.step()  # the error is held
    engine.abort("a")
    assert len(llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == GREEDY.max_tokens


@pytest.mark.parametrize("error", [MemoryError("injected: host copy failed"), KeyboardInterrupt()],
                         ids=["error", "ctrl_c"])
def test_close_shuts_the_executor_down_when_the_hand_off_to_disk_fails(model_dir, fresh, tmp_path, error,
                                                                       monkeypatch):
    """close() hands the cache to the disk tier before it shuts the executor down. A hand-off that raised (or a
    Ctrl-C on its progress bar) left the runner (tensor-parallel workers, the pools) up and the disk writer thread
    running, and close() was then a no-op: both now happen whatever the hand-off does, and its error is raised."""
    prompt, _ = fresh
    block_bytes = small_llm(model_dir).engine.memory_plan.block_bytes
    llm = small_llm(model_dir, host_cache_gib=64 * block_bytes / (1 << 30), disk_cache_dir=str(tmp_path))
    llm.generate([prompt], GREEDY, use_tqdm=False)
    engine = llm.engine
    shut_down = []
    monkeypatch.setattr(engine.runner, "shutdown", lambda: shut_down.append(1))

    def keep_at_shutdown(keep_behind):
        raise error

    monkeypatch.setattr(engine.disk, "keep_at_shutdown", keep_at_shutdown)
    with pytest.raises(type(error)):
        llm.close()
    assert shut_down == [1] and engine.runner is None
    assert not engine.disk.disk._writer.is_alive()
    llm.close()  # idempotent
    with pytest.raises(EngineDeadError, match="closed"):
        llm.generate([prompt], GREEDY, use_tqdm=False)


def test_a_progress_bar_that_fails_to_build_queues_nothing(model_dir):
    """`use_tqdm` as a callable (vLLM's) whose bar raises: the prompts used to be queued already and stayed so
    (the next generate ran them all first, their outputs dropped)."""
    llm = small_llm(model_dir)

    def broken_bar(**kwargs):
        raise RuntimeError("the progress bar broke")

    with pytest.raises(RuntimeError, match="progress bar"):
        llm.generate(prompts_of([40, 70, 30], seed=7), GREEDY, use_tqdm=broken_bar)
    assert not llm.engine.has_unfinished_requests()
    assert llm.reset_prefix_cache()
