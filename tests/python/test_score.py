"""engine.score against the engine's perplexity evaluation (`oryx eval ppl`) on the same text and schedules."""
import json

import pytest

from conftest import MODEL_DIR, SOURCE_DIR, run_oryx

TEXT = SOURCE_DIR / "tests" / "data" / "default_model" / "val-100000.txt"
SCHEDULES = ["attention", "linear", "mixed", "lin-to-attn:150"]
SEQ_LEN = 300  # more than one prefill span of the CPU backend (256 tokens)


@pytest.fixture(scope="module")
def evaluation():
    """`oryx eval ppl` over the text's first window, and that window: BOS, then the text's tokens, as the
    evaluation reads a text file."""
    report = json.loads(run_oryx("eval", "ppl", "--model", MODEL_DIR, "--text", str(TEXT), "--seq-len",
                                 str(SEQ_LEN), "--sequences", "1", "--schedules", *SCHEDULES, "--json"))
    return {r["schedule"]: r for r in report["results"]}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_score_agrees_with_the_perplexity_evaluation(engine, evaluation, schedule):
    window = engine.tokenizer.encode(TEXT.read_text(), bos=True)[:SEQ_LEN + 1]
    logprobs = engine.score(window, modes=schedule)
    assert len(logprobs) == SEQ_LEN
    want = evaluation[schedule]["per_position_loss"]
    # The evaluation forwards the window as one span of 300 rows, score as spans of 256 and 44: fp32 logits
    # rounded differently (differences up to 1e-5 were seen), the same numbers otherwise.
    assert [-lp for lp in logprobs] == pytest.approx(want, rel=1e-5, abs=5e-5)
    assert -sum(logprobs) / SEQ_LEN == pytest.approx(evaluation[schedule]["loss"], rel=1e-6)


def test_modes_per_token_are_the_schedule_they_spell(engine):
    tokens = engine.tokenizer.encode("for (i = 0; i < n; i++)\n\tsum += a[i];\n", bos=True)
    n, switch = len(tokens), 5
    by_name = engine.score(tokens, modes=f"lin-to-attn:{switch}")
    spelled = ["linear"] * switch + ["attention"] * (n - switch)
    assert engine.score(tokens, modes=spelled) == by_name
    assert engine.score(tokens, modes=spelled[:-1]) == by_name  # the last token's mode is never used
    assert engine.score(tokens, modes="attention") != by_name
    # From a later token, the tokens before it run as a span of their own: the same numbers up to rounding.
    assert engine.score(tokens, start=3) == pytest.approx(engine.score(tokens)[2:], rel=1e-5)
    assert engine.score(tokens, start=0) == [None, *engine.score(tokens)]


def test_a_continuation_scores_from_where_it_starts(engine):
    # As an RL reward would score it: the generated tokens after their prompt. A greedy continuation is likelier
    # than one sampled hot from the same prompt.
    prompt = engine.tokenizer.encode("static int foo_probe(struct platform_device *pdev)", bos=True)
    result = engine.generate(prompt, max_tokens=16)
    scored = engine.score(prompt + result.tokens, start=len(prompt))
    assert len(scored) == len(result.tokens)
    assert all(lp <= 0 for lp in scored)
    sampled = engine.generate(prompt, max_tokens=16, temperature=1.5, seed=3)
    assert sum(engine.score(prompt + sampled.tokens, start=len(prompt))) < sum(scored)
