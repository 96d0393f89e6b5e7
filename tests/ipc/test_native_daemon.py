"""o3edged serving a CPU preset's engine (the default backend "auto" picks "native"): a real daemon answers over
ZeroMQ without torch in its process (its memory maps hold no libtorch), and its KV blocks survive kill -9 in the
shared-memory cold tier."""

import pytest

from conftest import DaemonProcess
from o3edge import O3Config, O3Model
from o3edge.engine import cpu_features, native_lib
from o3edge.engine.sequence import SamplingParams
from o3edge.ipc.client import O3Client
from test_cold_tier_daemon import answer_then_kill_9, system_prompt

pytestmark = pytest.mark.skipif(not native_lib.available(),
                                reason="this CPU lacks AVX-512 VNNI and AVX-VNNI (or no g++)")


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory, tiny_dir):
    import torch

    from o3edge.engine.engine_dir import build_engine_dir

    path = str(tmp_path_factory.mktemp("native-daemon") / "tiny-cpu-int8")
    build_engine_dir(tiny_dir, path, torch.float32, None, preset="cpu-int8")
    return path


def native_daemon(directory, model_dir, cold_dir) -> DaemonProcess:
    """The default backend ("auto"): an engine of a CPU preset is served natively."""
    return DaemonProcess(str(directory), model_dir, tables={"kv": {"cold_tier_mb": 32, "cold_tier_dir": cold_dir}})


def test_native_daemon_answers_without_torch_and_keeps_its_cold_tier(tmp_path, engine_dir, shm):
    prompt = system_prompt(engine_dir)

    def no_torch(d):
        with open(f"/proc/{d.proc.pid}/maps") as fh:
            maps = fh.read()
        assert "libtorch" not in maps and "libo3core" in maps
        with O3Client(d.endpoint, timeout=10) as c:
            info = c.info()
            assert info["backend"] == "native" and info["cpu_kernels"] == cpu_features.row_kernel_isa() is not None

    before, full_blocks = answer_then_kill_9(native_daemon(tmp_path, engine_dir, shm), prompt, 12, no_torch)
    second = native_daemon(tmp_path, engine_dir, shm).start()
    try:
        second.wait_ready(timeout=120)
        with O3Client(second.endpoint, timeout=60) as c:
            after = c.generate(prompt, max_tokens=12, ignore_eos=True)
    finally:
        assert second.stop() == 0
    assert after.token_ids == before.token_ids
    assert after.usage["cold_tokens"] >= (full_blocks - 1) * 32
    local = O3Model.from_config(O3Config(model_path=engine_dir, backend="native", num_kv_blocks=256))
    expected = local.generate_batch([local.engine.encode(prompt)], SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert before.token_ids == expected[0].token_ids
