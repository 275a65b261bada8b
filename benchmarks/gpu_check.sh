#!/usr/bin/env bash
# Issue #26's check on a fresh GPU machine, run from the repository root:
#   bash benchmarks/gpu_check.sh
# installs the wheels carried in .whl/ (trio, outcome, sniffio, cattrs, pytest-trio: the
# GPU machines have CuPy, NCCL, PyTorch and pytest but not these; benchmarks/gpu_wheels.sh
# downloads them where there is a network), prints the GPUs and the versions, runs the
# GPU tests (pytest -m gpu), then benchmarks/gpu.py, its profile of (c) (--only e) and
# benchmarks/gpu_configs.py, each even when an earlier step failed. Everything printed is
# also written to $OUT (default /tmp/out) as gpu_check.log, beside gpu.py's Chrome
# traces. 8 minutes at most: each step has a time limit (PYTEST_LIMIT, BENCH_LIMIT,
# PROFILE_LIMIT, CONFIGS_LIMIT seconds); GPU_BENCH_ARGS passes options to gpu.py (e.g.
# --quick). Exit status: 0 if every step passed.
set -u
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
PYTEST_LIMIT=${PYTEST_LIMIT:-150}
BENCH_LIMIT=${BENCH_LIMIT:-180}
CONFIGS_LIMIT=${CONFIGS_LIMIT:-60}
PROFILE_LIMIT=${PROFILE_LIMIT:-90}
mkdir -p "$OUT"
started=$SECONDS
stage() { echo; echo "== $1 (at $((SECONDS - started)) s)"; }

check() {  # the whole check, its output teed below (unindented: the here-documents end at column 0)

stage "wheels"
shopt -s nullglob
wheels=(.whl/*.whl)
if ((${#wheels[@]})); then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${wheels[@]}" \
        || echo "gpu_check: installing the wheels failed (exit $?)"
else
    echo "gpu_check: no wheels in .whl/"
fi
export PYTHONPATH=$PWD:/tmp/site

stage "machine"
nvidia-smi -L || echo "gpu_check: nvidia-smi failed (exit $?)"
python3 - <<'EOF'
import platform, sys
print("python", platform.python_version(), sys.executable)
for name in ("numpy", "cupy", "torch", "trio", "cattrs", "pytest"):
    try:
        module = __import__(name)
        print(name, getattr(module, "__version__", "?"), getattr(module, "__file__", ""))
    except Exception as err:
        print(name, "not importable:", repr(err))
try:
    import cupy
    props = cupy.cuda.runtime.getDeviceProperties(0)
    print("cupy: CUDA runtime", cupy.cuda.runtime.runtimeGetVersion(), "driver",
          cupy.cuda.runtime.driverGetVersion(), "devices", cupy.cuda.runtime.getDeviceCount(),
          "device 0", props["name"].decode() if isinstance(props["name"], bytes) else props["name"])
except Exception as err:
    print("cupy: no GPU:", repr(err))
try:
    import torch
    print("torch: cuda", torch.version.cuda, "available", torch.cuda.is_available())
except Exception as err:
    print("torch:", repr(err))
try:
    import actorflow
    print("actorflow", actorflow.__file__)
    from actorflow.runtime.cuda import unavailable
    print("actorflow.runtime.cuda.unavailable():", unavailable())
except Exception as err:
    print("actorflow:", repr(err))
EOF

stage "pytest -m gpu (limit ${PYTEST_LIMIT} s)"
timeout -k 10 "$PYTEST_LIMIT" python3 -m pytest -m gpu -q -p no:randomly -p no:xdist -o addopts="" \
    --timeout 300 -rfEs --durations=10 2>&1 | tee /tmp/pytest.txt
tests=$?
echo "gpu_check: pytest exit status $tests$([ "$tests" = 124 ] && echo ' (time limit)')"

stage "benchmarks/gpu.py ${GPU_BENCH_ARGS:-} (limit ${BENCH_LIMIT} s)"
# shellcheck disable=SC2086 # GPU_BENCH_ARGS is split into options on purpose
timeout -k 10 "$BENCH_LIMIT" python3 benchmarks/gpu.py --out "$OUT" ${GPU_BENCH_ARGS:-} 2>&1 | tee /tmp/gpu.txt
bench=$?
echo "gpu_check: gpu.py exit status $bench$([ "$bench" = 124 ] && echo ' (time limit)')"

stage "benchmarks/gpu.py --only e (limit ${PROFILE_LIMIT} s)"
timeout -k 10 "$PROFILE_LIMIT" python3 benchmarks/gpu.py --only e 2>&1 | tee /tmp/profile.txt
profile=$?
echo "gpu_check: gpu.py --only e exit status $profile$([ "$profile" = 124 ] && echo ' (time limit)')"

stage "benchmarks/gpu_configs.py (limit ${CONFIGS_LIMIT} s)"
timeout -k 10 "$CONFIGS_LIMIT" python3 benchmarks/gpu_configs.py 2>&1 | tee /tmp/configs.txt
configs=$?
echo "gpu_check: gpu_configs.py exit status $configs$([ "$configs" = 124 ] && echo ' (time limit)')"

stage "done"
echo "gpu_check: pytest $tests, gpu.py $bench, gpu.py --only e $profile, gpu_configs.py $configs; output in $OUT"
[ "$tests" = 0 ] && [ "$bench" = 0 ] && [ "$profile" = 0 ] && [ "$configs" = 0 ]
}

check 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
