# Sourced by every device call script: libraries, the model and corpus unpacked, and the binaries (carried,
# built here on the 2-core VM for sm_90a; built on the machine when they do not run there).
set -uo pipefail
export LD_LIBRARY_PATH=/opt/deps/usr/lib/x86_64-linux-gnu:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export ORYX_SOURCE_DIR=$PWD
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
mkdir -p /opt/deps $OUT data out/r build-gpu/bin
for f in .deps/*.deb; do dpkg -x "$f" /opt/deps; done
[[ -f models/default/config.json ]] || tar -xJf .xa/model.tar.xz
[[ -d data/c1 ]] || { mkdir -p data/c1 && tar -xJf .xb/c1.tar.xz -C data/c1; }
if [[ ! -x build-gpu/bin/oryx ]]; then
  for b in oryx cuda_backend_test ops_cuda_test; do xz -dc .carry/bin2/$b.xz > build-gpu/bin/$b && chmod +x build-gpu/bin/$b; done
  if ! build-gpu/bin/oryx --help > /dev/null 2>&1; then
    echo "carried binaries do not run: $(build-gpu/bin/oryx --help 2>&1 | head -2); building"
    rm -f build-gpu/bin/*
    scripts/device-build --no-tests --targets "oryx cuda_backend_test ops_cuda_test" > /tmp/b.log 2>&1 || { tail -40 /tmp/b.log; exit 1; }
  fi
fi
echo "ready at $(el) s (rev $(cat .carry/rev))"
