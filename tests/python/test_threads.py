"""One engine from several Python threads: each call's result is what it is alone, and the GIL is released while
the engine runs, so other Python threads go on meanwhile."""
import threading
import time

from test_generate import PROMPTS


def run_together(*jobs, timeout=300):
    """Runs each job in a thread of its own, all started at once; returns their (result, start, end) in order and
    fails on any exception or a thread that does not finish (a deadlock)."""
    start = threading.Barrier(len(jobs))
    outcomes = [None] * len(jobs)

    def run(i, job):
        try:
            start.wait()
            began = time.perf_counter()
            outcomes[i] = (job(), began, time.perf_counter())
        except BaseException as e:  # reported below, in the test's thread
            outcomes[i] = e

    threads = [threading.Thread(target=run, args=(i, job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a thread did not finish"
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
    return outcomes


def test_generation_from_two_threads_at_once_is_correct(engine):
    def batches():
        return [[r.tokens for r in engine.generate(PROMPTS, policy="speculative:4", max_tokens=24)]
                for _ in range(3)]

    def streams():
        return [[t.id for t in engine.stream(prompt, policy=policy, max_tokens=40)]
                for prompt, policy in [(PROMPTS[1], "attention"), (PROMPTS[2], "speculative:2"),
                                       (PROMPTS[0], "prefill-linear")]]

    alone = [batches(), streams()]
    (got_batches, b0, b1), (got_streams, s0, s1) = run_together(batches, streams)
    assert b0 < s1 and s0 < b1, "the two threads did not run at the same time"
    assert got_batches == alone[0]
    assert got_streams == alone[1]


def test_many_threads_at_once_are_correct(engine):
    policies = ["attention", "speculative:4", "entropy:2", "linear"]
    alone = [engine.generate(PROMPTS[i % 3], policy=p, max_tokens=16).tokens for i, p in enumerate(policies)]
    jobs = [lambda i=i, p=p: engine.generate(PROMPTS[i % 3], policy=p, max_tokens=16).tokens
            for i, p in enumerate(policies)]
    assert [tokens for tokens, _, _ in run_together(*jobs)] == alone


def test_the_gil_is_released_while_the_engine_runs(engine):
    finished = threading.Event()

    def work():
        engine.generate(PROMPTS[0], max_tokens=96)
        finished.set()

    worker = threading.Thread(target=work)
    began = last = time.perf_counter()
    worker.start()
    longest_pause = 0.0
    while not finished.is_set():  # this thread's Python goes on while the engine runs in the other
        now = time.perf_counter()
        longest_pause, last = max(longest_pause, now - last), now
    elapsed = time.perf_counter() - began
    worker.join()
    assert elapsed > 0.2, "the generation was too short to tell"
    # Holding the GIL, the engine would have stopped this loop for the whole generation.
    assert longest_pause < elapsed / 2, f"paused {longest_pause:.3f} s of {elapsed:.3f} s"
