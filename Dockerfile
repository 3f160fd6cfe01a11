# ap-realtime in a container: `ap-realtime serve`, configured only by AP_* variables.
#
#   docker build -t ap-realtime --build-arg VERSION=0.2.0 .   # from PyPI, on python:3.11-slim
#   docker build --build-arg BASE=debian:bookworm-slim-with-python3 ...
#
# Where the build cannot reach a package index, build wheels on the host first
# and install from them: scripts/build-image does that (with podman).

ARG BASE=python:3.11-slim-bookworm

FROM ${BASE} AS build
# Extra pip arguments and what to install, e.g. for prebuilt wheels:
#   --build-arg PIP_ARGS="--no-index --find-links /src/wheels" --build-arg INSTALL=ap-realtime
ARG PIP_ARGS=""
ARG INSTALL=/src
RUN python3 -m venv /opt/ap-realtime
COPY . /src
RUN /opt/ap-realtime/bin/pip install --no-cache-dir --disable-pip-version-check \
        -c /src/constraints.txt ${PIP_ARGS} ${INSTALL} \
    && find /opt/ap-realtime -name __pycache__ -prune -exec rm -rf {} + \
    && rm -rf /opt/ap-realtime/lib/python3*/site-packages/pip

FROM ${BASE}
# The release (server/__init__.py, CHANGELOG.md); scripts/build-image passes it.
ARG VERSION=unknown
LABEL org.opencontainers.image.title="ap-realtime" \
      org.opencontainers.image.version="${VERSION}"
COPY --from=build /opt/ap-realtime /opt/ap-realtime
ENV PATH=/opt/ap-realtime/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    AP_HOST=0.0.0.0 \
    AP_HTTP_HOST=0.0.0.0 \
    AP_PORT=8765 \
    AP_HTTP_PORT=8766
# No account needed: a numeric user that owns nothing in the image.
USER 10001:10001
# 8765 is the public WebSocket port; 8766 (publish, health, metrics, the
# operator's page) must stay inside the cluster network.
EXPOSE 8765 8766
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('AP_HTTP_PORT', '8766') + '/healthz', timeout=2)"]
ENTRYPOINT ["ap-realtime", "serve"]
