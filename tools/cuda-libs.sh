# shellcheck shell=bash
# tools/cuda-libs.sh — sourced (bash), not run: how every script of nmt finds the CUDA libraries
# a CUDA build loads, cuBLASLt (linked, libcublasLt.so.13) and NCCL (dlopen'ed for several GPUs,
# libnccl.so.2), on a machine whose layout it does not know (a GPU machine's image, a CUDA 13 pip
# wheel, a toolkit under /usr/local). Used by tools/gpu-check.sh and bench/gpu-compare.sh.
#
#   nmt_find_lib LIB     prints "DIR SOURCE" for the first directory holding LIB, searched in this
#                        order: the dynamic loader's cache (SOURCE ldconfig), the toolkit
#                        ($CUDA_HOME, /usr/local/cuda*; toolkit), the pip wheels of every python3
#                        (nvidia/cu13/lib for the CUDA 13 wheels, nvidia/cublas/lib and
#                        nvidia/nccl/lib for older ones; pip), then a find over / cut at
#                        $FIND_SECONDS (default 15; find). Prints nothing if none; returns 0.
#   nmt_cuda_lib_path    for each of libcublasLt.so.13 and libnccl.so.2: finds it, prints
#                        "LIB: DIR (SOURCE) -> file" or "LIB: NOT FOUND (...)", and appends DIR to
#                        LD_LIBRARY_PATH (exported; dlopen honours it too) unless the loader's
#                        cache has it already.
# Environment: CUDA_HOME (default /usr/local/cuda), FIND_SECONDS.

nmt_find_lib() {
  local lib=$1 d py sp hit home=${CUDA_HOME:-/usr/local/cuda}
  hit=$(ldconfig -p 2>/dev/null | awk -v l="$lib" '$1 == l && /x86-64/ {print $NF; exit}')
  [ -n "$hit" ] && { echo "$(dirname "$hit") ldconfig"; return 0; }
  for d in "$home/lib64" "$home/lib" "$home/targets/x86_64-linux/lib" \
           /usr/local/cuda/lib64 /usr/local/cuda-*/lib64 /usr/local/cuda-*/lib \
           /usr/local/cuda-*/targets/x86_64-linux/lib; do
    [ -e "$d/$lib" ] && { echo "$d toolkit"; return 0; }
  done
  for py in python3 /usr/bin/python3 /opt/torch/.venv/bin/python3; do
    command -v "$py" > /dev/null 2>&1 || continue
    for sp in $("$py" -c 'import site, sys
print("\n".join(site.getsitepackages() + [site.getusersitepackages()] + sys.path))' 2>/dev/null |
                sort -u); do
      for d in "$sp"/nvidia/cu13/lib "$sp"/nvidia/cublas/lib "$sp"/nvidia/nccl/lib; do
        [ -e "$d/$lib" ] && { echo "$d pip"; return 0; }
      done
    done
  done
  hit=$(timeout "${FIND_SECONDS:-15}" find / \( -path /proc -o -path /sys -o -path /dev \
          -o -path /run \) -prune -o -name "$lib*" \( -type f -o -type l \) -print 2>/dev/null |
        head -1)
  [ -n "$hit" ] && echo "$(dirname "$hit") find"
  return 0
}

nmt_cuda_lib_path() {
  local want found dir src
  for want in libcublasLt.so.13 libnccl.so.2; do
    found=$(nmt_find_lib "$want")
    if [ -z "$found" ]; then
      echo "$want: NOT FOUND (loader cache, ${CUDA_HOME:-/usr/local/cuda}, pip wheels, find /)"
      continue
    fi
    dir=${found% *} src=${found##* }
    echo "$want: $dir ($src) -> $(basename "$(readlink -f "$dir/$want")")"
    [ "$src" = ldconfig ] || export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$dir
  done
  return 0
}
