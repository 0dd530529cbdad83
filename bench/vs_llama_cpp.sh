#!/usr/bin/env bash
# Conveyor against llama.cpp on the same fp32 checkpoint, side by side on this machine:
#   1. llama.cpp built from the llama-cpp-python sdist (a package registry is enough; cmake, a C++
#      compiler), the checkpoint converted to GGUF f32 (its converter needs the tokenizer's
#      pre-tokenizer named: the project's splits as qwen2's does);
#   2. in process: `llama-bench` tg128 against `python -m bench.decode_rows` (kernel and torch);
#   3. served: `llama-server` and a `conveyor bench serve --start` stack, alternating, through the
#      same client at concurrency 1, 8 and 64 (32 prompt tokens, 128 out, EOS ignored).
# Results under $OUT (default /tmp/vs-llama-cpp), one line per run on stdout.
#
#   bash bench/vs_llama_cpp.sh                      # the cached `small` llama, 2 rounds
#   ROUNDS=3 THREADS=2 MODEL=DIR bash bench/vs_llama_cpp.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
ROUNDS=${ROUNDS:-2}
THREADS=${THREADS:-$(nproc)}
OUT=${OUT:-/tmp/vs-llama-cpp}
WORK=${WORK:-$HOME/.cache/conveyor/llama.cpp}
MODEL=${MODEL:-$($PY -c 'from executor.make_model import cached_model; print(cached_model("llama", "small"))')}
PORT=${PORT:-8090}
mkdir -p "$OUT" "$WORK"
pid=""
trap '[ -n "$pid" ] && kill "$pid" 2> /dev/null || true' EXIT  # no llama-server left behind by a failed run

# 1. llama.cpp and the GGUF.
if [ ! -x "$WORK/bin/llama-server" ]; then
  $PY -m pip download -q --no-binary :all: --no-deps llama-cpp-python -d "$WORK/sdist"
  tar -xzf "$WORK"/sdist/llama_cpp_python-*.tar.gz -C "$WORK"
  SRC=$(ls -d "$WORK"/llama_cpp_python-*/vendor/llama.cpp | head -1)
  cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF > "$OUT/cmake.log"
  cmake --build "$WORK/build" -j"$(nproc)" --target llama-server llama-bench > "$OUT/build.log"
  mkdir -p "$WORK/bin" && cp -a "$WORK"/build/bin/* "$WORK/bin/"
fi
SRC=$(ls -d "$WORK"/llama_cpp_python-*/vendor/llama.cpp | head -1)
GGUF="$WORK/$(basename "$MODEL")-f32.gguf"
if [ ! -f "$GGUF" ]; then
  # The converter identifies pre-tokenizers by a hash of their output and refuses unknown ones;
  # the first "res = None" of that function becomes the answer for this tokenizer.
  grep -rl 'chkhsh = sha256' "$SRC"/conversion "$SRC"/convert_hf_to_gguf.py 2>/dev/null \
    | xargs sed -i '0,/^        res = None$/s//        res = "qwen2"/'
  STUB="$WORK/stub"  # the converter imports sentencepiece, which a tokenizer.json model never uses
  mkdir -p "$STUB/sentencepiece"
  $PY -c 'import sentencepiece' 2>/dev/null || printf 'class SentencePieceProcessor:\n    def __init__(self, *a, **k):\n        raise FileNotFoundError("no sentencepiece")\n' > "$STUB/sentencepiece/__init__.py"
  PYTHONPATH="$SRC/gguf-py:$STUB" $PY "$SRC/convert_hf_to_gguf.py" "$MODEL" --outtype f32 --outfile "$GGUF" > "$OUT/convert.log" 2>&1
fi

# 2. In process.
for r in $(seq 1 "$ROUNDS"); do
  echo "llama-bench round $r: $("$WORK/bin/llama-bench" -m "$GGUF" -t "$THREADS" -p 0 -n 128 -r 3 2>/dev/null | grep tg128 | awk -F'|' '{print $(NF-1)}') tok/s (tg128)"
  PYTHONPATH=. $PY -m bench.decode_rows --model "$MODEL" --rows 1 8 | sed "s/^/round $r: /"
done

# 3. Served.
summary() {  # completed, output tok/s, median TTFT ms, median TPOT ms of one result file
  $PY -c 'import json, sys; d = json.load(open(sys.argv[1])); print("%d done, %.1f tok/s, TTFT %.1f ms, TPOT %.2f ms" % (d["completed"], d["output_throughput"], d["median_ttft_ms"], d["median_tpot_ms"]))' "$1"
}
COMMON=(--num-prompts 0 --random-input-len 32 --random-output-len 128 --ignore-eos --disable-tqdm)
for r in $(seq 1 "$ROUNDS"); do
  for c in 1 8 64; do
    n=$((c == 1 ? 8 : c == 8 ? 32 : 128))
    COMMON[1]=$n
    "$WORK/bin/llama-server" -m "$GGUF" -t "$THREADS" -c $((c * 2048)) --parallel "$c" --port "$PORT" --host 127.0.0.1 > "$OUT/llama-server.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 60); do curl -sf "127.0.0.1:$PORT/health" > /dev/null && break; sleep 1; done
    $PY -m bench.serve --base-url "http://127.0.0.1:$PORT" --tokenizer "$MODEL" --max-concurrency "$c" "${COMMON[@]}" \
      --result-file "$OUT/llama_c${c}_r${r}.json" > "$OUT/llama_c${c}_r${r}.txt" 2>&1
    kill "$pid" && wait "$pid" 2> /dev/null || true
    pid=""
    $PY -m bench.serve --start --model "$MODEL" --num-blocks 2048 --max-concurrency "$c" "${COMMON[@]}" \
      --result-file "$OUT/conveyor_c${c}_r${r}.json" > "$OUT/conveyor_c${c}_r${r}.txt" 2>&1
    echo "concurrency $c round $r: llama-server $(summary "$OUT/llama_c${c}_r${r}.json") | conveyor $(summary "$OUT/conveyor_c${c}_r${r}.json")"
  done
done
