"""Bad input raises an oryx.Error subclass carrying the engine's message, never a crash, and leaves the engine
working."""
import pytest

import oryx
from conftest import MODEL_DIR


def test_the_errors_are_also_the_built_in_exceptions_a_caller_expects():
    assert issubclass(oryx.InvalidArgumentError, oryx.Error) and issubclass(oryx.InvalidArgumentError, ValueError)
    assert issubclass(oryx.NotFoundError, oryx.Error) and issubclass(oryx.NotFoundError, FileNotFoundError)
    assert issubclass(oryx.ResourceExhaustedError, oryx.Error)


def test_a_bad_model_path_device_or_thread_count(tmp_path):
    with pytest.raises(oryx.NotFoundError, match="missing-model: not a checkpoint directory"):
        oryx.Engine(str(tmp_path / "missing-model"))
    with pytest.raises(FileNotFoundError, match="config.json: cannot open"):
        oryx.Engine(str(tmp_path))  # a directory without a model
    with pytest.raises(oryx.Error, match="unknown device 'tpu'"):
        oryx.Engine(MODEL_DIR, device="tpu")
    for threads in [-1, 100000]:
        with pytest.raises(oryx.InvalidArgumentError, match=rf"threads must be in \[0, 1024\].*got {threads}"):
            oryx.Engine(MODEL_DIR, threads=threads)
    with pytest.raises(oryx.InvalidArgumentError, match=r"unknown weight format 'int4' \(f32, bf16, int8, w8a8, fp8\)"):
        oryx.Engine(MODEL_DIR, weights="int4")
    with pytest.raises(oryx.InvalidArgumentError, match=r"weights 'fp8' are the CUDA backend's"):
        oryx.Engine(MODEL_DIR, weights="fp8")
    with pytest.raises(oryx.InvalidArgumentError, match=r"unknown KV cache type 'fp8' \(f32, bf16, int8\)"):
        oryx.Engine(MODEL_DIR, kv_dtype="fp8")


def test_a_bad_policy(engine):
    with pytest.raises(oryx.InvalidArgumentError, match=r"unknown policy 'fastest' \(attention, linear,"):
        engine.generate("int main", policy="fastest")
    with pytest.raises(ValueError, match="1 <= K <= 64"):
        engine.generate("int main", policy="speculative:0")
    with pytest.raises(oryx.Error, match="no-such-policy.safetensors"):
        engine.generate("int main", policy="learned:no-such-policy.safetensors")
    with pytest.raises(oryx.InvalidArgumentError, match="unknown policy 'fastest'"):
        engine.stream("int main", policy="fastest")
    with pytest.raises(oryx.InvalidArgumentError, match="request 0: unknown policy"):
        engine.generate(["int main", [2, 100]], policy="fastest")


def test_a_prompt_longer_than_the_context(engine):
    context = engine.config["max_position"]
    with pytest.raises(oryx.InvalidArgumentError, match=f"the prompt is {context} tokens; this model takes at most"):
        engine.generate([engine.tokenizer.bos_id] + [100] * (context - 1))
    with pytest.raises(oryx.InvalidArgumentError, match=f"the prompt is {context + 1} tokens"):
        engine.stream("\n" * context)  # a newline is one token, after the BOS
    with pytest.raises(oryx.InvalidArgumentError, match=f"request 1: the prompt is {context + 1} tokens"):
        engine.generate(["int main", "\n" * context])


def test_bad_arguments_to_generate(engine):
    with pytest.raises(oryx.InvalidArgumentError, match="empty prompt"):
        engine.generate("")
    with pytest.raises(oryx.InvalidArgumentError, match=r"top_p must be in \(0, 1\]"):
        engine.generate("int main", top_p=0)
    with pytest.raises(oryx.InvalidArgumentError, match="max_tokens"):
        engine.generate("int main", max_tokens=0)
    with pytest.raises(oryx.InvalidArgumentError, match="stop"):
        engine.generate("int main", stop="")
    with pytest.raises(TypeError):
        engine.generate(42)


def test_bad_arguments_to_score(engine):
    tokens = engine.tokenizer.encode("int main(void)", bos=True)
    with pytest.raises(oryx.InvalidArgumentError, match=f"score: 2 modes for {len(tokens)} tokens"):
        engine.score(tokens, modes=["attention", "linear"])
    with pytest.raises(oryx.InvalidArgumentError, match=f"score: {len(tokens) + 1} modes"):
        engine.score(tokens, modes=["attention"] * (len(tokens) + 1))
    with pytest.raises(oryx.InvalidArgumentError, match="mode 'fast' is not attention or linear"):
        engine.score(tokens, modes=["fast"] * len(tokens))
    with pytest.raises(oryx.InvalidArgumentError, match="unknown schedule 'mostly-attention'"):
        engine.score(tokens, modes="mostly-attention")
    with pytest.raises(oryx.InvalidArgumentError, match="score: from 99 outside"):
        engine.score(tokens, start=99)
    context = engine.config["max_position"]
    with pytest.raises(oryx.InvalidArgumentError, match=f"this model takes at most {context}"):
        engine.score([100] * (context + 1))


def test_the_engine_still_works_after_errors(engine):
    want = engine.generate("int main", max_tokens=8, policy="speculative:4").tokens
    for bad in [dict(policy="fastest"), dict(top_p=2.0), dict(max_tokens=-1), dict(stop=[""])]:
        with pytest.raises(oryx.Error):
            engine.generate("int main", **bad)
    with pytest.raises(oryx.Error):
        engine.score([2, 100], modes="sometimes")
    assert engine.generate("int main", max_tokens=8, policy="speculative:4").tokens == want
