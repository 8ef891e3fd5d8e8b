# The gateway's container image: built in one stage, run from a second, slim one as an unprivileged user,
# with the o200k vocabulary written at build time (the gateway never downloads it at run time).
#
#   docker build -t harmony-gateway:0.1.0 .
#   docker run --rm -p 8000:8000 harmony-gateway:0.1.0 --host 0.0.0.0 --worker-url grpc://engine:30000
#
# Arguments after the image name are `harmony-gateway serve` options. Kubernetes manifests:
# deploy/kubernetes/; running it: docs/operations.md.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
# The venv lives where the runtime stage copies it, so its scripts' interpreter paths stay right.
RUN python -m venv /opt/harmony-gateway
COPY pyproject.toml README.md ./
COPY src ./src
RUN /opt/harmony-gateway/bin/pip install --no-cache-dir . \
    && /opt/harmony-gateway/bin/harmony-gateway vocab --out /opt/harmony-gateway/cache/vocab

FROM ${PYTHON_IMAGE}
# A fixed uid/gid, so Kubernetes' runAsUser/fsGroup can name them (deploy/kubernetes/deployment.yaml).
RUN groupadd --system --gid 10001 gateway \
    && useradd --system --uid 10001 --gid gateway --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin gateway \
    && install -d -o gateway -g gateway -m 0750 /var/lib/harmony-gateway
COPY --from=build /opt/harmony-gateway /opt/harmony-gateway
# HARMONY_GATEWAY_CACHE_DIR: where the gateway finds the vocabulary written at build time (checked
# against its sha256 at start-up, never rewritten). XDG_DATA_HOME: where the default SQLite storage goes
# when no --storage is given (a volume; replicas share PostgreSQL instead).
ENV PATH=/opt/harmony-gateway/bin:$PATH \
    HARMONY_GATEWAY_CACHE_DIR=/opt/harmony-gateway/cache \
    XDG_DATA_HOME=/var/lib/harmony-gateway \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
VOLUME ["/var/lib/harmony-gateway"]
USER 10001:10001
EXPOSE 8000
# /health answers while the process serves; /readiness (a healthy engine) is for load balancers.
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2).status != 200)"]
ENTRYPOINT ["harmony-gateway", "serve"]
CMD ["--host", "0.0.0.0", "--port", "8000", "--log-json"]
