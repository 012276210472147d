#!/usr/bin/env bash
# Download the wheels bench/gpu_smoke.sh installs on the lent GPU machine into .gpu-wheels/ (git-ignored; name it in
# the device tool's `carry`). That machine reaches no registry; its image already holds torch 2.11, transformers,
# safetensors, tokenizers, pyarrow, fsspec, pandas, xxhash, huggingface-hub, psutil, numpy, matplotlib, jinja2,
# pyyaml, nvidia-ml-py, pytest (its package list, as last read). What the library imports beyond that:
#   pydantic (+ pydantic-core, annotated-types, typing-inspection, typing-extensions >= 4.16 that pydantic needs)
#   datasets (load_from_disk / save_to_disk of the prepared data; + dill, multiprocess)
# Not carried: pyarrow (55 MB for cp312: with the ~19 MB tracked tree it would pass the 64 MiB limit; the image's
# own is used), prefect and vllm (the GPU tests call the library; tests/conftest.py imports tasks/prefect_env.py,
# which imports no Prefect; tests marked `vllm` skip without a vLLM interpreter), gguf.
# Versions = the pipeline venv's (.venv), so the GPU run exercises what the tests here exercise. datasets 5.2 asks for
# pyarrow >= 24; for an image with pyarrow 21-23 datasets 5.0.0 (pyarrow >= 21) is downloaded too and gpu_smoke.sh
# picks it. Compiled wheels come for CPython 3.10-3.13 (the image's python was 3.12.3 when last seen).
#
#     bash bench/gpu_smoke_wheels.sh        # ~9 MB into .gpu-wheels/, prints the sizes
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-.venv/bin/pip}
DEST=.gpu-wheels
PURE=(pydantic==2.14.4 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
      datasets==5.2.0 datasets==5.0.0 dill==0.4.1)
COMPILED=(pydantic-core==2.50.5 multiprocess==0.70.19)  # one wheel per CPython version
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

mkdir -p "$DEST"
for req in "${PURE[@]}"; do
  "$PIP" download -q --no-deps --only-binary=:all: -d "$DEST" "$req"
done
for py in 3.10 3.11 3.12 3.13; do
  "$PIP" download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp "${PLATFORMS[@]}" \
    -d "$DEST" "${COMPILED[@]}"
done
# what gpu_smoke.sh installs (datasets chosen there by the image's pyarrow version)
printf '%s\n' pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing-extensions==4.16.0 dill==0.4.1 multiprocess==0.70.19 >"$DEST/requirements.txt"
ls -l "$DEST"
echo "wheels: $(du -cb "$DEST"/*.whl | tail -1 | cut -f1) bytes in $DEST;" \
  "tracked tree: $(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) bytes (limit 67108864 together)"
