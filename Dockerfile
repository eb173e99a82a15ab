# syntax=docker/dockerfile:1
# The loopwarden worker image: `docker build -t loopwarden .` (docker-compose.yml builds it for you).
#
# Three stages: the native stage builds the native engine (native/, Rust) into an abi3 wheel with
# maturin; the build stage installs loopwarden[worker] and that wheel into a virtualenv (with a
# compiler, because faust-streaming has no wheel for some platforms, e.g. arm64); the runtime stage is
# python slim plus that virtualenv, running as an unprivileged user, with the RocksDB state in a volume.
# The worker folds telemetry with the native engine (LOOPWARDEN_ENGINE=auto finds it). Configured by
# environment variables only (README, "Worker configuration").

ARG PYTHON_VERSION=3.11

FROM rust:1-slim-bookworm AS native
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/maturin && /opt/maturin/bin/pip install 'maturin>=1.7,<2'
WORKDIR /src/native
COPY native/Cargo.toml native/Cargo.lock native/pyproject.toml ./
COPY native/src ./src
# abi3-py311: one wheel for every CPython >= 3.11 on this platform.
RUN /opt/maturin/bin/maturin build --release --locked --out /wheels

FROM python:${PYTHON_VERSION}-slim-bookworm AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/loopwarden
WORKDIR /src
# Only what the wheel is built from (see .dockerignore), so edits to tests or docs reuse this layer.
COPY pyproject.toml README.md ./
COPY schemas ./schemas
COPY stream_app ./stream_app
COPY --from=native /wheels /wheels
RUN /opt/loopwarden/bin/pip install --prefer-binary '.[worker]' /wheels/loopwarden_native-*.whl

FROM python:${PYTHON_VERSION}-slim-bookworm
LABEL org.opencontainers.image.title="loopwarden" \
      org.opencontainers.image.description="Fleet-wide streaming detector that halts runaway AI-agent tool loops" \
      org.opencontainers.image.licenses="Apache-2.0"
# A fixed numeric uid/gid, so Kubernetes' runAsNonRoot can verify it and volumes can be chowned to it.
RUN groupadd --system --gid 10001 loopwarden \
    && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/loopwarden --no-create-home \
       --shell /usr/sbin/nologin loopwarden \
    && mkdir -p /var/lib/loopwarden/state /etc/loopwarden \
    && chown -R 10001:10001 /var/lib/loopwarden
COPY --from=build /opt/loopwarden /opt/loopwarden
ENV PATH=/opt/loopwarden/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    LOOPWARDEN_STATE_DIR=/var/lib/loopwarden/state \
    LOOPWARDEN_METRICS_PORT=9464 \
    LOOPWARDEN_METRICS_HOST=0.0.0.0
WORKDIR /var/lib/loopwarden
USER 10001:10001
# RocksDB state (one directory per worker instance); recovered from the changelog topic if lost.
VOLUME ["/var/lib/loopwarden/state"]
# Prometheus metrics (LOOPWARDEN_METRICS_PORT).
EXPOSE 9464
ENTRYPOINT ["loopwarden"]
CMD ["worker"]
