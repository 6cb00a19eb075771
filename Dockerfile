# distanom on a CUDA PyTorch image. Build: docker build -t distanom .
# Run a job: launch/docker.sh train.py (one node, or several: see that file), i.e.
#   docker run --gpus all --ipc host -v $PWD:/work -w /work distanom \
#     torchrun --nproc-per-node 8 -m distanom.launch train.py
# TraceLens (optional: distanom's built-in tables equal its output) is added with
#   docker build --build-arg WITH_TRACELENS=1 -t distanom .
FROM pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime

ARG WITH_TRACELENS=0
WORKDIR /opt/distanom
COPY pyproject.toml README.md ./
COPY distanom ./distanom
COPY configs ./configs
COPY examples ./examples
COPY launch ./launch
# torch comes with the image; the low-overhead NVIDIA backend calls the libcupti that
# CUDA builds of torch ship (no extra Python package)
RUN pip install --no-cache-dir ".[plots]" \
    && if [ "$WITH_TRACELENS" = "1" ]; then \
         pip install --no-cache-dir "git+https://github.com/AMD-AGI/TraceLens.git"; \
       fi
ENTRYPOINT []
CMD ["distanom", "--help"]
