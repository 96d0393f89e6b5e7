"""Shared fixtures: small random checkpoints made once per test session."""

import os
import uuid

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run on CPU tensors through the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpret_device_calls_without_repatching():
    """Triton's interpreter patches triton.language for the whole of a launch, and then again on every
    call of a @triton.jit helper inside it (never undone: the launch's restore covers it): a fifth of an
    interpreted decode step's time (py-spy). Here each module's helpers patch once a launch, on their
    first call; the kernels' arithmetic is the interpreter's own either way."""
    try:
        from triton.runtime import interpreter
    except ImportError:  # no Triton here: the kernel tests are skipped
        return
    if not hasattr(interpreter, "_patch_lang") or not hasattr(interpreter.InterpretedFunction, "rewrite"):
        return  # another Triton: leave it as it is
    patched = None  # ids of the helper modules patched in the running launch
    launch = interpreter.GridExecutor.__call__

    def launch_once(self, *args, **kwargs):
        nonlocal patched
        outer, patched = patched, set()
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched = outer

    def call(self, *args, **kwargs):
        module = id(self.fn.__globals__)
        if patched is None or module not in patched:
            interpreter._patch_lang(self.fn)
            if patched is not None:
                patched.add(module)
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    interpreter.GridExecutor.__call__ = launch_once
    interpreter.InterpretedFunction.__call__ = call


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpret_device_calls_without_repatching()

from o3edge.tiny import corpus, make_checkpoint

# small variants of the tiny shape, one per family feature the engine must get right
VARIANTS = {
    "llama-tied": dict(family="llama"),
    "llama3-rope-untied": dict(
        family="llama", tie_word_embeddings=False, num_heads=4, num_kv_heads=1, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}),
    "qwen2-bias": dict(family="qwen2", num_heads=8, num_kv_heads=4),
    "qwen3-qknorm": dict(family="qwen3", num_heads=4, num_kv_heads=2, head_dim=96, tie_word_embeddings=False),
    "mha-sharded": dict(family="llama", num_heads=4, num_kv_heads=4),
}


@pytest.fixture(scope="session")
def texts():
    return corpus(60)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory, texts):
    """name -> directory of a random checkpoint, made on first use."""
    root = tmp_path_factory.mktemp("ckpt")
    made = {}

    def get(name):
        if name not in made:
            spec = dict(VARIANTS[name])
            shards = 2 if name == "mha-sharded" else 1
            made[name] = make_checkpoint(os.path.join(root, name), seed=len(made), num_shards=shards,
                                         texts=texts, **spec)
        return made[name]

    return get


@pytest.fixture(scope="session")
def tiny_dir(checkpoints):
    return checkpoints("llama-tied")


@pytest.fixture
def shm():
    """A private directory in /dev/shm (a real tmpfs), removed afterwards."""
    path = os.path.join("/dev/shm", f"o3edge-test-{uuid.uuid4().hex}")
    os.mkdir(path)
    yield path
    for name in os.listdir(path):
        os.unlink(os.path.join(path, name))
    os.rmdir(path)
