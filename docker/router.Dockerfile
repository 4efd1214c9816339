# deepinfer router: the OpenAI-compatible proxy in front of worker replicas. No torch.
#   docker build -f docker/router.Dockerfile -t deepinfer/router:0.1.0 .
#   docker run -p 8080:8080 deepinfer/router:0.1.0 \
#       router --host 0.0.0.0 --port 8080 --backend http://WORKER:8000
# The router needs workers (--backend, or --prefill/--decode): arguments given to the container
# replace the whole CMD, so they start with `router`.
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/home/deepinfer

COPY docker/router-requirements.txt /tmp/router-requirements.txt
RUN groupadd --gid 10001 deepinfer \
    && useradd --no-log-init --uid 10001 --gid 10001 --create-home --home-dir /home/deepinfer \
        --shell /usr/sbin/nologin deepinfer \
    && pip install --no-cache-dir -r /tmp/router-requirements.txt \
    && rm /tmp/router-requirements.txt

# only what `deepinfer router` runs: the namespace package, the CLI entry point (server/cli.py) and router/
COPY pyproject.toml setup.py README.md /tmp/deepinfer/
COPY deepinfer /tmp/deepinfer/deepinfer
COPY server /tmp/deepinfer/server
COPY router /tmp/deepinfer/router
RUN pip install --no-cache-dir --no-deps /tmp/deepinfer \
    && rm -rf /tmp/deepinfer

USER 10001:10001
WORKDIR /home/deepinfer
EXPOSE 8080
# /liveness is 200 while the router serves (/health also needs an admitted worker: a router
# waiting for its workers is not unhealthy)
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/liveness', timeout=4)"]
ENTRYPOINT ["deepinfer"]
CMD ["router", "--host", "0.0.0.0", "--port", "8080"]
