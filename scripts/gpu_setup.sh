# Source this on a GPU machine without network (the device tool's): it installs the wheels
# carried in .whl/ (open_clip_torch, webdataset 1.x, inf-cl, nvImageCodec, nvJPEG) into /tmp/site
# and webdataset 0.2.86 (.whl-oc/, what open_clip_train needs) into /tmp/oc, and starts writing
# 260 shards of 512 224-px JPEGs in the background unless they are there (`wait` for them):
# short captions to /tmp/shards, or with `web` as the second argument web-length captions
# (make_synthetic_shards.py --captions web) to /tmp/shards-web. Then run scripts/bench_*.py as usual.
#
#   source scripts/gpu_setup.sh <commit> [short|web]; wait; python3 scripts/bench_e2e.py ...
install="python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade"
$install --target /tmp/site .whl/*.whl || return 1
$install --target /tmp/oc .whl-oc/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CLIPSCALE_GIT_COMMIT=${1:-unknown}
captions=${2:-short}
shards=/tmp/shards$([ "$captions" = web ] && echo -web)
if [ ! -f "$shards/synthetic-0259.tar" ]; then
    python3 scripts/make_synthetic_shards.py --out "$shards" --shards 260 --size 224 --captions "$captions" \
        --processes "$(nproc)" &
fi
nvidia-smi -L
