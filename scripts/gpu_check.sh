#!/usr/bin/env bash
# One device call (see docs/benchmarks.md, "On a GPU"): the CUDA tests, the Triton kernels'
# tests, a profile of a decode step, `strata bench engine --device cuda` at 100/50/25% coverage
# with prefetch off and on, bf16 against fp32 weights, the same weights as a Q8_0 GGUF, and the
# HTTP serving path against the in-process engine. Writes logs and JSON under $OUT (default
# ./gpu-out). Wheels for packages the machine lacks may sit in .whl/ (installed into /tmp/site
# first). STEPS picks steps (default: all of "tests profile static eager crf dtype batch gguf
# serve"); a device lease is short, so pick what the change touched.
set -u
OUT=${OUT:-gpu-out}
STEPS=" ${STEPS:-tests profile static eager crf dtype batch gguf serve} "
want() { [[ "$STEPS" == *" $1 "* ]]; }
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if [ -z "${SKIP_WHEELS:-}" ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
step() { echo; echo "=== $1 ($(date +%T))"; }
if want tests; then
step "tests"  # every cuda-marked test, and the Triton kernels' tests (on the device when it has one)
timeout ${TEST_S:-240} python3 -m pytest -q -p no:cacheprovider -o addopts= --maxfail=4 --timeout 120 \
  tests/engine/test_gpu_moe.py \
  tests/engine/test_cache_cuda.py tests/engine/test_runner.py tests/engine/test_cache_placement.py \
  tests/engine/test_quant_experts.py tests/engine/test_plan_apply.py \
  -k "cuda or gpu_moe" 2>&1 | tee "$OUT/tests.log" | tail -25
fi
python3 -m services.cli model demo --preset bench --output /tmp/bench-moe >/dev/null 2>&1
if want profile; then
step "profile"
timeout 60 python3 scripts/gpu_profile.py --model /tmp/bench-moe --steps 32 2>&1 \
  | grep -v "^\[" | tee "$OUT/profile.txt" | head -40
fi
BENCH="python3 -m services.cli bench engine --model /tmp/bench-moe --device cuda --json"
LOG="$OUT/bench.log"
if want static; then
step "bench: static residency, 100/50/25% coverage"
timeout 110 $BENCH --prompt-tokens 32 --gen-tokens 64 --repeat 2 --coverage 1 0.5 0.25 \
  --policy static --compare-hf > "$OUT/static.json" 2>> "$LOG"; grep round "$LOG" | tail -6
fi
if want eager; then
step "bench: the same without CUDA graphs"
timeout 90 $BENCH --prompt-tokens 32 --gen-tokens 64 --repeat 2 --coverage 1 0.25 \
  --policy static --cuda-graphs off > "$OUT/static_eager.json" 2>> "$LOG"; grep round "$LOG" | tail -4
fi
if want crf; then
step "bench: crf, prefetch off and on"
timeout 110 $BENCH --prompt-tokens 32 --gen-tokens 64 --repeat 2 --coverage 1 0.5 0.25 \
  --prefetch off on > "$OUT/crf.json" 2>> "$LOG"; grep round "$LOG" | tail -6
fi
if want dtype; then
step "bench: bf16 against fp32 weights, interleaved (100% and 25% coverage)"
timeout 120 $BENCH --prompt-tokens 32 --gen-tokens 64 --repeat 2 --coverage 1 0.25 \
  --dtype fp32 bf16 > "$OUT/dtype.json" 2>> "$LOG"; grep round "$LOG" | tail -4
fi
if want batch; then
step "bench: batch 8 and prefill 512"
timeout 40 $BENCH --prompt-tokens 32 --gen-tokens 64 --batch 8 > "$OUT/batch8.json" 2>> "$LOG"
timeout 40 $BENCH --prompt-tokens 512 --gen-tokens 8 > "$OUT/prefill512.json" 2>> "$LOG"
fi
if want gguf; then
step "bench: the same weights as a Q8_0 GGUF (experts and lm_head dequantized in registers)"
if python3 -c "import gguf" 2>/dev/null && timeout 90 python3 scripts/demo_gguf.py /tmp/bench-moe \
    /tmp/bench-q8_0.gguf --type Q8_0 > /dev/null 2>> "$LOG"; then
  timeout 90 ${BENCH/bench-moe/bench-q8_0.gguf} --prompt-tokens 32 --gen-tokens 64 --repeat 2 \
    --coverage 1 0.25 --policy static > "$OUT/gguf.json" 2>> "$LOG"; grep round "$LOG" | tail -4
else echo "no gguf package: the GGUF step is left out"; fi
fi
if want serve; then
step "serving path: strata up on the device over HTTP against the in-process engine, 1 and 8 clients"
timeout ${SERVE_S:-200} python3 scripts/serve_vs_llama_server.py --model /tmp/bench-moe \
  --device cuda --engine-threads 4 --rounds 2 > "$OUT/serve.json" 2>> "$OUT/serve.log"
grep -E "round|ready|Error" "$OUT/serve.log" | tail -12
echo "the whole engine in process (scheduler, sampler, detokenizer; TTFT included), 128 tokens:"
timeout 120 python3 scripts/engine_rate.py /tmp/bench-moe --device cuda --threads 4 --clients 1 8 \
  2>> "$OUT/serve.log" | tee "$OUT/engine_rate.txt"
fi
step "summary"
python3 - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
for name in ("static", "static_eager", "crf", "dtype", "batch8", "prefill512", "gguf"):
    if not (out / f"{name}.json").exists():
        continue  # a step left out
    try:
        d = json.loads((out / f"{name}.json").read_text())
    except Exception as e:
        print(name, "unreadable:", e); continue
    for r in d.get("runs", [d]):
        print(f"{name:10} prefetch {'on ' if r['prefetch'] else 'off'} cov {r['coverage']:.0%} "
              f"hit {r['decode_hit_rate']:.1%} spill {r['decode_spill']:.1%} decode "
              f"{r['decode_tok_s']:.0f} tok/s prefill {r['prefill_tok_s']:.0f} bound "
              f"{r['bound_fraction']:.1%} hf {r.get('hf_decode_tok_s', 0):.0f} "
              f"graphs {r.get('cuda_graphs')} {r.get('dtype', 'fp32')}")
    if "spill_penalty" in d:
        print(name, "spill penalty", d["spill_penalty"])
    if "dtype_ratio" in d:
        print(name, "dtype ratio", d["dtype_ratio"])
serve = out / "serve.json"
if serve.exists():
    d = json.loads(serve.read_text())
    for c, lv in d["levels"].items():
        s = lv["strata"]
        print(f"serve {c} client(s): {s['aggregate_tok_s']:.0f} tok/s aggregate, "
              f"{s['stream_decode_tok_s']:.0f} per stream, TTFT p50 {s['ttft_p50_ms']:.1f} ms")
    if "in_process_decode_tok_s" in d:
        print(f"serve in-process decode {d['in_process_decode_tok_s']:.0f} tok/s, "
              f"HTTP / in-process {d.get('http_over_in_process', 0):.2f}")
PY
