"""Generation through the module: each result equals `oryx generate --json`'s, token for token and count for count;
lists of prompts run as one batch; streams yield the same tokens as they come."""
import pytest

import oryx
from conftest import SOURCE_DIR, cli_generate, run_oryx

# A learned policy trained for the bundled model (results/2026-12-02-h200-graph-rows/README.md).
LEARNED = "learned:" + str(SOURCE_DIR / "results" / "2026-12-02-h200-graph-rows" / "router-16k-lambda0.3.safetensors")
PROMPTS = ["static int foo_probe(struct platform_device *pdev)", "The scheduler picks the next task", "def main():\n"]
MAX_TOKENS = 32
# The statistics that count things (the others are timings, which differ from run to run).
COUNTS = ["prompt_tokens", "cached_tokens", "preemptions", "generated_tokens", "attention_tokens", "linear_tokens",
          "attention_fraction"]
SPEC_COUNTS = ["rounds", "drafted", "accepted", "acceptance_rate", "mean_accepted_per_round", "drafted_at",
               "accepted_at", "rounds_by_length"]


def assert_same_result(got, want):
    """got (an oryx.Result) holds what want (`oryx generate --json`'s object) holds, timings aside."""
    assert got.tokens == want["tokens"]
    assert got.text == want["text"]
    assert got.finish_reason == want["finish_reason"]
    assert got.policy == want["policy"]
    assert got.to_dict().keys() == want.keys()
    assert got.stats.keys() == want["stats"].keys()
    for key in COUNTS:
        assert got.stats[key] == want["stats"][key], key
    if "spec" in want["stats"]:
        for key in SPEC_COUNTS:
            assert got.stats["spec"][key] == want["stats"]["spec"][key], key


@pytest.mark.parametrize("policy", ["attention", "speculative:4", "entropy:2", LEARNED])
def test_greedy_generate_equals_the_command(engine, policy):
    got = engine.generate(PROMPTS[0], policy=policy, max_tokens=MAX_TOKENS)
    assert isinstance(got, oryx.Result)
    assert_same_result(got, cli_generate(PROMPTS[0], policy, MAX_TOKENS))


def test_a_bf16_kv_cache_generates_what_the_command_generates_with_one():
    bf16 = oryx.Engine(str(SOURCE_DIR / "models" / "default"), kv_dtype="bf16")
    got = bf16.generate(PROMPTS[0], policy="speculative:4", max_tokens=MAX_TOKENS)
    assert_same_result(got, cli_generate(PROMPTS[0], "speculative:4", MAX_TOKENS, "--kv-dtype", "bf16"))


def test_speculative_results_carry_the_speculation_statistics(engine):
    stats = engine.generate(PROMPTS[0], policy="speculative:4", max_tokens=MAX_TOKENS).stats
    assert stats["spec"]["drafted"] > 0
    assert stats["spec"]["acceptance_rate"] == stats["spec"]["accepted"] / stats["spec"]["drafted"]
    assert 0 < stats["attention_fraction"] < 1
    assert "spec" not in engine.generate(PROMPTS[0], max_tokens=4).stats


def test_sampling_and_stop_strings_reach_the_engine_as_the_command_gives_them(engine):
    sampled = dict(temperature=0.8, top_p=0.9, top_k=40, seed=7)
    got = engine.generate(PROMPTS[1], max_tokens=MAX_TOKENS, **sampled)
    assert_same_result(got, cli_generate(PROMPTS[1], "attention", MAX_TOKENS, "--temperature", "0.8", "--top-p",
                                         "0.9", "--top-k", "40", "--seed", "7"))
    assert got.tokens != engine.generate(PROMPTS[1], max_tokens=MAX_TOKENS, **dict(sampled, seed=8)).tokens
    stopped = engine.generate(PROMPTS[0], max_tokens=MAX_TOKENS, stop=["priv;", "never"])
    assert stopped.finish_reason == "stop"
    assert_same_result(stopped, cli_generate(PROMPTS[0], "attention", MAX_TOKENS, "--stop", "priv;", "never"))
    assert engine.generate(PROMPTS[0], max_tokens=MAX_TOKENS, stop="priv;").text == stopped.text


def test_a_list_of_prompts_is_one_batch_whose_results_are_the_commands(engine):
    got = engine.generate(PROMPTS, policy="speculative:4", max_tokens=MAX_TOKENS)
    assert isinstance(got, list) and len(got) == len(PROMPTS)
    for prompt, result in zip(PROMPTS, got):
        assert result.tokens == cli_generate(prompt, "speculative:4", MAX_TOKENS)["tokens"]


def test_token_prompts_are_used_as_given(engine):
    ids = engine.tokenizer.encode(PROMPTS[0], bos=True)
    assert ids[0] == engine.tokenizer.bos_id and engine.tokenizer.decode(ids) == PROMPTS[0]
    by_text = engine.generate(PROMPTS[0], max_tokens=16)
    by_ids = engine.generate(ids, max_tokens=16)
    assert by_ids.tokens == by_text.tokens
    assert by_ids.stats["prompt_tokens"] == len(ids)
    mixed = engine.generate([ids, PROMPTS[1]], max_tokens=16)
    assert mixed[0].tokens == by_text.tokens
    assert mixed[1].tokens == engine.generate(PROMPTS[1], max_tokens=16).tokens


def test_stream_yields_the_tokens_as_they_are_produced(engine):
    want = engine.generate(PROMPTS[0], policy="speculative:4", max_tokens=MAX_TOKENS)
    stream = engine.stream(PROMPTS[0], policy="speculative:4", max_tokens=MAX_TOKENS)
    first = next(stream)
    assert stream.result is None  # the first token came while the request was still running
    tokens = [first, *stream]
    assert [t.id for t in tokens] == want.tokens
    assert "".join(t.text for t in tokens) == want.text
    assert stream.result.tokens == want.tokens
    assert stream.result.stats["spec"]["accepted"] == want.stats["spec"]["accepted"]
    with pytest.raises(StopIteration):
        next(stream)


def test_a_character_split_between_tokens_comes_whole_with_the_token_that_completes_it(engine):
    # Sampled from this prompt, the model writes an umlaut as two byte-fallback tokens.
    stream = engine.stream("Die Größe der Überprüfung ist äöü äöü ", max_tokens=40, temperature=1.0, seed=1)
    tokens = list(stream)
    held = [t.id for t in tokens if t.text == ""]
    assert held, "no token held part of a character back: nothing was tested"
    assert all(20 <= i < 276 for i in held), "only byte pieces (ids 20-275) split characters"
    assert "".join(t.text for t in tokens) == stream.result.text
    assert "\ufffd" not in stream.result.text


def test_a_stream_closed_or_dropped_unfinished_gives_the_engine_back(engine):
    stream = engine.stream(PROMPTS[1], max_tokens=500)
    next(stream)
    next(stream)
    del stream  # dropped in the middle of its request
    with engine.stream(PROMPTS[1], policy="speculative:4", max_tokens=500) as stream:
        first = next(stream)
    with pytest.raises(StopIteration):  # leaving the with block ended it
        next(stream)
    assert stream.result is None
    stream.close()  # again: nothing happens
    assert engine.generate(PROMPTS[1], max_tokens=1).tokens == [first.id]


def test_policies_lists_every_policy_the_command_takes_with_its_usage(engine):
    usages = oryx.policies()
    assert usages["periodic"] == "periodic:N"
    assert usages["speculative"] == "speculative[:K], speculative:ngram[:K]"
    assert usages["learned"] == "learned:PATH"
    generate_help = run_oryx("generate", "--help")
    for name, usage in usages.items():
        assert usage.split(",")[0] in generate_help, name
    for usage in ["attention", "linear", "prefill-linear", "periodic:3", "speculative", "speculative:ngram:2",
                  "entropy:1.5", "budget:0.2", "match:8", "random:0.3", LEARNED]:
        assert engine.generate(PROMPTS[2], policy=usage, max_tokens=4).policy == usage
