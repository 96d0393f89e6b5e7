# call 4 (2026-12-04 fourteenth session): the GPU tests of the decode graphs with the step's event recorded on an
# explicit stream (cuda_graph.DecodeGraphs._launch)
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
timeout 460 python3 -m pytest -m gpu tests/engine/test_gpu.py tests/engine/test_router_graph.py -q 2>&1 | tail -15 > $OUT/gpu-tests.log
cat $OUT/gpu-tests.log
