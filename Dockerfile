# Rollout Recorder server image: the recorder sidecar next to the trainers.
#
#   docker build -t rollout-recorder .
#   docker run -p 50051:50051 -v recorder-data:/data rollout-recorder
#
# Token auth: mount the token file as a secret and point the server at it, either
#   with ROLLOUT_RECORDER_TOKEN_FILE=/run/secrets/recorder_token (serve reads it
#   as the default of --token-file), or by appending to the command
#   --token-file /run/secrets/recorder_token (docker-compose.yml does this).
# TLS: add --tls-cert F --tls-key F [--tls-client-ca F] to the command, and give
#   the health check --tls-ca F (and --tls-server-name NAME if the certificate
#   does not name 127.0.0.1).
#
# tests/test_deploy.py parses this file: it runs the `pip install` line below in a
# fresh virtualenv and checks that every COPY source exists, so keep the install
# on one RUN line.

ARG PYTHON_VERSION=3.11.13
FROM python:${PYTHON_VERSION}-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

# A fixed, unprivileged uid/gid so volume ownership is predictable.
RUN groupadd --system --gid 10001 recorder \
    && useradd --system --uid 10001 --gid recorder --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin recorder

# Runtime dependencies only: the package with its [server] extra, no dev tools.
WORKDIR /build
COPY pyproject.toml README.md ./
COPY client ./client
COPY server ./server
RUN pip install --no-cache-dir ".[server]"
# The trajectory store's compiled loops (numba), built once here into a cache the server
# user can read and extend, instead of at the first session with a store (~30 s).
ENV NUMBA_CACHE_DIR=/var/cache/rollout-recorder/numba
RUN python -m recorder_server.store \
    && chown -R recorder:recorder /var/cache/rollout-recorder
WORKDIR /
RUN rm -rf /build \
    && mkdir -p /data \
    && chown recorder:recorder /data

USER recorder
# A new named volume starts as a copy of this directory, owned by recorder.
VOLUME /data
EXPOSE 50051

# grpc.health.v1 Check: exit 0 only when the server says SERVING (needs no token).
HEALTHCHECK --interval=10s --timeout=5s --start-period=10s --retries=3 \
    CMD ["rollout-recorder", "health", "--target", "127.0.0.1:50051", "--timeout", "3"]

CMD ["rollout-recorder", "serve", "--listen", "0.0.0.0:50051", "--data-dir", "/data"]
