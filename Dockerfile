# imp_jax on an NVIDIA GPU (CUDA 12). Build and run: docs/DEPLOYMENT.md, "Container".
#   docker build -t imp-jax .
#   docker run --gpus all -p 8080:8080 -v imp-cache:/var/cache/imp_jax imp-jax
FROM nvidia/cuda:12.6.3-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/imp/bin:$PATH \
    IMP_JAX_HOME=/var/cache/imp_jax

# Python for the virtual environment. Versions follow the base image.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# The server runs as `imp` (uid 10001); the cache home (models, compiled programs) is its own, mode 0700,
# as imp_jax requires of every directory it loads code or weights from (docs/SECURITY.md).
RUN useradd --create-home --uid 10001 --user-group imp \
    && python3 -m venv /opt/imp \
    && mkdir -p /var/cache/imp_jax \
    && chown imp:imp /var/cache/imp_jax \
    && chmod 0700 /var/cache/imp_jax

WORKDIR /opt/imp-src
COPY pyproject.toml README.md ./
COPY imp_jax ./imp_jax
# the project itself: its dependencies' versions are pyproject.toml's
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[cuda12]"

USER 10001:10001
WORKDIR /home/imp
VOLUME ["/var/cache/imp_jax"]
EXPOSE 8080
# /ready is 200 once a request would be taken; the first start fetches the model and compiles.
# (urlopen raises on a 503: exit status 1, unhealthy)
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/ready', timeout=4)"]
ENTRYPOINT ["python", "-m", "imp_jax.server", "--host", "0.0.0.0", "--port", "8080"]
