# Source this on a GPU machine without network (the device tool's): it installs the wheels
# carried in .whl/ (open_clip_torch, webdataset 1.x, inf-cl, nvImageCodec, nvJPEG) into /tmp/site
# and webdataset 0.2.86 (.whl-oc/, what open_clip_train needs) into /tmp/oc, and starts writing
# 260 shards of 512 JPEGs in the background unless they are there (`wait` for them): 224-px noise
# squares with short captions to /tmp/shards, with `web` as the second argument web-length captions
# (make_synthetic_shards.py --captions web) to /tmp/shards-web, with `img` images as img2dataset
# writes them and web-length captions (--images web --captions web) to /tmp/shards-img: what speed
# claims use. A third argument writes that many shards instead (64 take ~30 s: enough for a resampled
# run, `data.resampled`). py-spy (carried as a wheel) lands on the PATH, and `spy_on_training FILE
# SECONDS` dumps train.py's main thread and clipscale's own threads (page-locking, decoding, work
# ahead) into FILE every SECONDS, in the background. `keep_compiled_code DIR` writes what the runs
# compiled and tuned into DIR ($OUT): the towers' portable cache (bench_e2e's cache=/tmp/cc_b32) and the
# Inf-CL kernels' tuning choices; copied here into .warm/ and carried (`carry` names .warm), the next
# machine's setup puts them back, and its first step compiles and tunes little (a machine goes back
# between calls). Then run scripts/bench_*.py as usual.
#
#   source scripts/gpu_setup.sh <commit> [short|web|img] [shards]; wait; python3 scripts/bench_e2e.py ...
install="python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade"
$install --target /tmp/site .whl/*.whl || return 1
$install --target /tmp/oc .whl-oc/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CLIPSCALE_GIT_COMMIT=${1:-unknown} PATH=/tmp/site/bin:$PATH
kind=${2:-short}
case $kind in
    short) shards=/tmp/shards; made="--captions short" ;;
    web) shards=/tmp/shards-web; made="--captions web" ;;
    img) shards=/tmp/shards-img; made="--captions web --images web" ;;
    *) echo "gpu_setup.sh: unknown shard kind $kind (short, web or img)"; return 1 ;;
esac
count=${3:-260}
if [ ! -f "$shards/synthetic-$(printf %04d $((count - 1))).tar" ]; then
    python3 scripts/make_synthetic_shards.py --out "$shards" --shards "$count" --size 224 $made --processes "$(nproc)" &
fi
export TRITON_CACHE_DIR=/tmp/triton_cache
if ls .warm/portable_cache.bin.gz.* > /dev/null 2>&1; then
    mkdir -p /tmp/cc_b32 && cat .warm/portable_cache.bin.gz.* | gunzip > /tmp/cc_b32/portable_cache.bin
fi
if [ -f .warm/triton_tuning.tgz ]; then
    mkdir -p $TRITON_CACHE_DIR && tar xzf .warm/triton_tuning.tgz -C $TRITON_CACHE_DIR
fi
keep_compiled_code() {
    [ -f /tmp/cc_b32/portable_cache.bin ] && gzip -1 -c /tmp/cc_b32/portable_cache.bin | split -b 15M - "$1/portable_cache.bin.gz."
    ( cd $TRITON_CACHE_DIR && find . -name '*.autotune.json' | tar czf "$1/triton_tuning.tgz" -T - )
}
spy_on_training() {
    ( started=$(date +%s)
      while sleep "$2"; do
          pid=$(pgrep -of 'train.py --config') || continue
          echo "=== $(( $(date +%s) - started )) s, pid $pid"
          py-spy dump --pid "$pid" 2>&1 | awk '/^Thread /{keep = /MainThread|clipscale-/} keep'
      done ) > "$1" 2>&1 &
}
nvidia-smi -L
